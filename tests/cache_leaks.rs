//! Nothing left behind: after SIGKILL of a client and of the server, the store's
//! shared memory is gone and so is every process (its own test binary, so no other
//! test moves the machine's Shmem meanwhile).

mod common;

use std::time::Duration;

use common::{fill_pattern, pin_process, shmem_bytes, wait_until, ServerProc};

const CAP: u64 = 128 << 20;
const SLACK: u64 = 16 << 20;
const FILLED_MB: u64 = 96;

#[test]
fn sigkill_of_client_and_server_leaves_no_shared_memory() {
    let before = shmem_bytes();
    let mut server = ServerProc::start("leak", &["--cap", "128M"]);
    let started = shmem_bytes();
    assert!(
        started < before + CAP / 2,
        "the store took its cap at start ({before} -> {started}): memory should follow the data"
    );
    // The store takes memory as it is filled: 96 records of 1 MiB.
    let client = server.client("test");
    for i in 0..FILLED_MB {
        fill_pattern(&client, &format!("r/{i}"), 1 << 20);
    }
    fill_pattern(&client, "k", 1 << 20);
    drop(client);
    let during = shmem_bytes();
    assert!(
        during >= before + (FILLED_MB << 20) - SLACK,
        "the store did not show in Shmem ({before} -> {during}): the test could not see a leak"
    );

    // A client holding leases is killed: the server keeps the store, nothing else leaks.
    let mut holder = pin_process(&server.address, &["k".to_string()]);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(server.alive());

    // A second client maps the store; then the server is killed. The client notices
    // the server is gone and exits, and the store's memory goes with the last mapping.
    let mut orphan = pin_process(&server.address, &["k".to_string()]);
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || matches!(
            orphan.try_wait(),
            Ok(Some(_))
        )),
        "a client outlived its server"
    );
    let status = orphan.wait().unwrap();
    assert!(!status.success(), "the orphan must report the lost server");
    assert!(
        wait_until(Duration::from_secs(5), || shmem_bytes() < before + SLACK),
        "shared memory left behind: {} -> {} bytes",
        before,
        shmem_bytes()
    );
}
