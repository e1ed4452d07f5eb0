use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::*;

fn dataset(dir: &Path) -> PathBuf {
    let root = dir.join("data");
    let seq = root.join("train").join("seq0");
    fs::create_dir_all(&seq).unwrap_or_else(|e| panic!("{e}"));
    fs::write(root.join("dataset.yaml"), "spike: 8\n").unwrap_or_else(|e| panic!("{e}"));
    fs::write(seq.join("0.png"), [1u8; 100]).unwrap_or_else(|e| panic!("{e}"));
    fs::write(seq.join("0.dat"), [2u8; 50]).unwrap_or_else(|e| panic!("{e}"));
    root
}

/// Everything a signature says about the dataset (not how long it took).
fn key(signature: &DatasetSignature) -> (PathBuf, u64, Tally, Coverage) {
    (
        signature.root.clone(),
        signature.digest,
        signature.tally.clone(),
        signature.coverage.clone(),
    )
}

fn full(threads: usize) -> SignOptions {
    SignOptions {
        threads,
        budget: Duration::from_secs(600),
    }
}

fn signed(root: &Path) -> DatasetSignature {
    sign_with(root, &full(4)).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn another_spelling_of_the_root_is_the_same_dataset() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let root = dataset(dir.path());
    let plain = signed(&root);
    assert_eq!((plain.tally.files, plain.tally.bytes), (3, 159));
    assert_eq!(plain.coverage, Coverage::Full);
    let dotted = signed(&root.join("train").join("..").join(".").join(""));
    assert_eq!(key(&plain), key(&dotted));
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&root, &link).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(key(&plain), key(&signed(&link)));
}

#[test]
fn a_touched_resized_added_or_removed_file_is_another_dataset() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let root = dataset(dir.path());
    let png = root.join("train").join("seq0").join("0.png");
    let before = signed(&root);
    assert_eq!(
        key(&before),
        key(&signed(&root)),
        "signing twice gives one signature"
    );

    let file = fs::File::options()
        .write(true)
        .open(&png)
        .unwrap_or_else(|e| panic!("{e}"));
    let later = SystemTime::now() + Duration::from_secs(5);
    file.set_modified(later).unwrap_or_else(|e| panic!("{e}"));
    let touched = signed(&root);
    assert_ne!(before.digest, touched.digest, "touched");

    file.set_len(99).unwrap_or_else(|e| panic!("{e}"));
    file.set_modified(later).unwrap_or_else(|e| panic!("{e}"));
    let resized = signed(&root);
    assert_ne!(touched.digest, resized.digest, "resized, same mtime");

    fs::write(root.join("extra.txt"), "x").unwrap_or_else(|e| panic!("{e}"));
    let added = signed(&root);
    assert_ne!(resized.digest, added.digest, "added");
    fs::remove_file(root.join("extra.txt")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(resized.digest, signed(&root).digest, "removed again");
}

#[test]
fn the_same_files_under_another_root_are_another_dataset() {
    let one = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let two = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = (dataset(one.path()), dataset(two.path()));
    // Same mtimes too: only the root differs.
    for root in [&a, &b] {
        for f in ["dataset.yaml", "train/seq0/0.png", "train/seq0/0.dat"] {
            let file = fs::File::options()
                .write(true)
                .open(root.join(f))
                .unwrap_or_else(|e| panic!("{e}"));
            file.set_modified(UNIX_EPOCH + Duration::from_secs(1_000_000))
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    assert_ne!(signed(&a).digest, signed(&b).digest);
}

#[test]
fn a_missing_root_names_it() {
    let err = sign(Path::new("/no/such/dataset")).unwrap_err();
    assert!(err.to_string().contains("/no/such/dataset"), "{err}");
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = dir.path().join("file");
    fs::write(&file, "x").unwrap_or_else(|e| panic!("{e}"));
    let err = sign(&file).unwrap_err();
    assert!(err.to_string().contains("Not a directory"), "{err}");
}

/// Many folders of many files, so that the walkers share them.
fn wide(dir: &Path, folders: usize, files: usize) -> PathBuf {
    let root = dir.join("wide");
    for s in 0..folders {
        let seq = root.join("train").join(format!("seq{s:03}")).join("blur");
        fs::create_dir_all(&seq).unwrap_or_else(|e| panic!("{e}"));
        for f in 0..files {
            fs::write(seq.join(format!("{f:04}.png")), [f as u8; 3])
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    root
}

#[test]
fn the_number_of_walkers_does_not_change_the_signature() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let root = wide(dir.path(), 40, 30);
    let one = sign_with(&root, &full(1)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((one.tally.files, one.tally.bytes), (1200, 3600));
    for threads in [2, 3, 8, 16] {
        let many = sign_with(&root, &full(threads)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(key(&one), key(&many), "{threads} walkers");
    }
}

/// Set in the child that signs as `nobody` (see below): the root to sign.
const AS_NOBODY_ENV: &str = "VRTSPIKE_TEST_SIGN_AS_NOBODY";

/// The signature of `root` as the user that reads it: printed on one line.
fn signature_line(root: &Path) -> String {
    let signature = signed(root);
    format!(
        "SIG {:016x} files={} unreadable={} dangling={} vanished={} examples={:?}",
        signature.digest,
        signature.tally.files,
        signature.tally.unreadable,
        signature.tally.dangling,
        signature.tally.vanished,
        signature.tally.examples
    )
}

/// `signature_line` of `root` as an ordinary user: this process when it is
/// one; as root (who reads a folder of mode 000), this test again as `nobody`.
fn signature_as_ordinary_user(root: &Path) -> String {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return signature_line(root);
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    let output = Command::new(exe)
        .args([
            "--exact",
            "dataset_sig::tests::unreadable_folders_and_dangling_links_sign_as_what_they_are",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(AS_NOBODY_ENV, root)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap_or_else(|e| panic!("running the test as nobody: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "as nobody: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The harness prints its test's name on the same line.
    stdout
        .lines()
        .find_map(|l| l.find("SIG ").map(|at| l[at..].to_string()))
        .unwrap_or_else(|| panic!("no signature from the child: {stdout}"))
}

#[test]
fn unreadable_folders_and_dangling_links_sign_as_what_they_are() {
    if let Some(root) = std::env::var_os(AS_NOBODY_ENV) {
        println!("{}", signature_line(Path::new(&root)));
        return;
    }
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let open = fs::Permissions::from_mode(0o755);
    fs::set_permissions(dir.path(), open).unwrap_or_else(|e| panic!("{e}"));
    let root = dataset(dir.path());
    let plain = signature_as_ordinary_user(&root);
    // A volume's lost+found (root's, mode 000 or 700) and a link to nothing, beside
    // the sequences and at the top.
    let lost = root.join("lost+found");
    fs::create_dir(&lost).unwrap_or_else(|e| panic!("{e}"));
    fs::write(lost.join("#1234"), "x").unwrap_or_else(|e| panic!("{e}"));
    let link = |name: &str| {
        std::os::unix::fs::symlink("/no/such/file", root.join(name))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    link("dangling-top");
    link("train/dangling-seq");
    fs::set_permissions(&lost, fs::Permissions::from_mode(0o000)).unwrap_or_else(|e| panic!("{e}"));
    let odd = signature_as_ordinary_user(&root);
    fs::set_permissions(&lost, fs::Permissions::from_mode(0o700)).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        odd.contains(" files=3 unreadable=1 dangling=2 vanished=0 ")
            && odd.contains("lost+found")
            && odd.contains("dangling-top"),
        "{odd}"
    );
    assert_ne!(
        plain[..20],
        odd[..20],
        "the odd entries are part of the signature"
    );
    // Each of them counts: without the dangling links it is another dataset again.
    for name in ["dangling-top", "train/dangling-seq"] {
        fs::remove_file(root.join(name)).unwrap_or_else(|e| panic!("{e}"));
    }
    let without_links = signature_as_ordinary_user(&root);
    assert!(without_links.contains(" dangling=0 "), "{without_links}");
    assert_ne!(odd[..20], without_links[..20]);
    assert_ne!(plain[..20], without_links[..20]);
}

#[test]
fn files_vanishing_during_the_walk_never_fail_it() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let root = wide(dir.path(), 8, 50);
    let stable = signed(&root);
    let churn = root.join("train").join("churn");
    fs::create_dir(&churn).unwrap_or_else(|e| panic!("{e}"));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (signatures, vanished) = std::thread::scope(|scope| {
        scope.spawn(|| {
            // Files and folders made and removed as fast as the machine goes.
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let file = churn.join(format!("f{}", i % 64));
                let folder = churn.join(format!("d{}", i % 16));
                let _ = fs::write(&file, "x");
                let _ = fs::create_dir(&folder);
                let _ = fs::write(folder.join("x"), "x");
                let _ = fs::remove_file(&file);
                let _ = fs::remove_file(folder.join("x"));
                let _ = fs::remove_dir(&folder);
                i += 1;
            }
        });
        let mut vanished = 0;
        let signatures: Vec<Result<DatasetSignature, String>> = (0..200)
            .map(|_| {
                let signature = sign_with(&root, &full(4)).map_err(|e| e.to_string());
                if let Ok(s) = &signature {
                    vanished += s.tally.vanished;
                }
                signature
            })
            .collect();
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        (signatures, vanished)
    });
    let failed: Vec<&String> = signatures.iter().filter_map(|s| s.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed.first()
    );
    println!("200 signatures during the churn, {vanished} entries seen vanishing");
    fs::remove_dir_all(&churn).unwrap_or_else(|e| panic!("{e}"));
    // The dataset itself was not touched: the same signature as before (the churn
    // folder's own listing is gone with it).
    assert_eq!(key(&stable), key(&signed(&root)));
}

#[test]
fn a_spent_budget_signs_the_top_folders_alike_every_time() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let root = wide(dir.path(), 12, 20);
    let spent = SignOptions {
        threads: 4,
        budget: Duration::ZERO,
    };
    let shallow = || sign_with(&root, &spent).unwrap_or_else(|e| panic!("{e}"));
    let first = shallow();
    let Coverage::Shallow { budget, .. } = first.coverage else {
        panic!("a spent budget read the whole tree");
    };
    assert_eq!(budget, Duration::ZERO);
    assert_eq!(key(&first), key(&shallow()), "alike every time");
    let whole = signed(&root);
    assert_ne!(first.digest, whole.digest, "never a full signature's");
    // Three levels of folders are listed (root, train, the sequences): a file
    // added in a sequence's folder changes the folder's mtime, which is read.
    let blur = root.join("train/seq003/blur");
    let before = fs::metadata(&blur)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("{e}"));
    fs::write(blur.join("new.png"), "x").unwrap_or_else(|e| panic!("{e}"));
    let dir_file = fs::File::open(&blur).unwrap_or_else(|e| panic!("{e}"));
    // Not left to the clock's granularity: the folder's mtime moves for sure.
    dir_file
        .set_modified(before + Duration::from_secs(3))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(first.digest, shallow().digest, "a frame added");
}

#[test]
fn the_budget_is_read_from_its_variable_and_a_bad_one_is_named() {
    let vars = |value: Option<&'static str>| {
        move |name: &str| {
            (name == BUDGET_ENV)
                .then_some(value)
                .flatten()
                .map(str::to_string)
        }
    };
    let default = SignOptions::from_vars(&vars(None)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(default.budget, Duration::from_secs_f64(DEFAULT_BUDGET_S));
    assert!((4..=MOST_THREADS).contains(&default.threads));
    let set = SignOptions::from_vars(&vars(Some("2.5"))).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(set.budget, Duration::from_millis(2500));
    let zero = SignOptions::from_vars(&vars(Some("0"))).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(zero.budget, Duration::ZERO);
    let bad = SignOptions::from_vars(&vars(Some("soon"))).unwrap_err();
    let text = bad.to_string();
    assert!(
        text.starts_with(BUDGET_ENV) && text.contains("\"soon\""),
        "{text}"
    );
}

#[test]
fn the_report_names_the_odd_entries() {
    let mut tally = Tally::default();
    tally.odd(OddKind::Unreadable, Path::new("/d"), b"lost+found");
    for i in 0..4 {
        tally.odd(
            OddKind::Dangling,
            Path::new("/d"),
            format!("l{i}").as_bytes(),
        );
    }
    assert_eq!(
        tally.to_string(),
        "1 unreadable, 4 dangling, 0 vanished (e.g. /d/lost+found: unreadable, /d/l0: \
         dangling, /d/l1: dangling)"
    );
}
