//! [`ProcessGroup`]: one rank's handle on a c10d process group (Gloo on CPU,
//! NCCL on CUDA) rendezvoused through a TCPStore, with in-place all-reduce,
//! broadcast and barrier that fail with the rank and op instead of hanging.

use std::ffi::{c_int, c_void, CString};
use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Tensor};
use vrtspike_contract::env::RankEnv;
use vrtspike_contract::heartbeat::CollectiveOp;

use super::error::DistError;
use super::ffi;
use super::progress::CollectiveObserver;

/// The communication library behind a process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Gloo: CPU tensors, any machine.
    Gloo,
    /// NCCL: CUDA tensors; only in builds where [`nccl_available`] is true.
    Nccl,
}

impl Backend {
    /// The lower-case name used in logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        }
    }

    fn code(self) -> c_int {
        match self {
            Backend::Gloo => ffi::BACKEND_GLOO,
            Backend::Nccl => ffi::BACKEND_NCCL,
        }
    }
}

/// Whether this binary was built with the NCCL backend (CUDA headers found).
pub fn nccl_available() -> bool {
    ffi::nccl_compiled()
}

/// How an all-reduce combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over ranks (floating-point tensors only).
    Avg,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
}

impl ReduceOp {
    fn code(self) -> c_int {
        match self {
            ReduceOp::Sum => ffi::OP_SUM,
            ReduceOp::Avg => ffi::OP_AVG,
            ReduceOp::Min => ffi::OP_MIN,
            ReduceOp::Max => ffi::OP_MAX,
        }
    }
}

/// Everything needed to join a process group.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// Communication library.
    pub backend: Backend,
    /// Host of rank 0's rendezvous store (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of rank 0's rendezvous store (`MASTER_PORT`).
    pub master_port: u16,
    /// This process's rank in `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Longest wait for the rendezvous and for any one collective.
    pub timeout: Duration,
    /// Key namespace in the store, so several groups (or restarts) can share it.
    pub prefix: String,
    /// CUDA device of this rank (NCCL only): the device of the rank's model.
    pub device_index: usize,
}

impl GroupOptions {
    /// The options of the rank that `env` describes (parsed once by the rank, see
    /// `vrtspike_contract::env`): its rank, world size and rendezvous, and for NCCL
    /// the CUDA device already chosen for its model, so both use the same GPU.
    /// Tests build [`GroupOptions`] field by field instead.
    pub fn for_rank(env: &RankEnv, backend: Backend, timeout: Duration) -> Result<Self, DistError> {
        let master = env.rendezvous()?;
        let device_index = match (backend, env.device.cuda_index()) {
            (_, Some(index)) => index as usize,
            (Backend::Gloo, None) => 0,
            (Backend::Nccl, None) => {
                return Err(DistError::Options(format!(
                    "rank {}: the nccl backend needs a CUDA device, but the rank's device is {}",
                    env.rank, env.device
                )))
            }
        };
        Ok(GroupOptions {
            backend,
            master_addr: master.addr.clone(),
            master_port: master.port,
            rank: env.rank as usize,
            world_size: env.world_size as usize,
            timeout,
            prefix: "default".into(),
            device_index,
        })
    }
}

/// Collectives a group has run, and the bytes they carried (this rank's view).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// All-reduce calls.
    pub all_reduces: u64,
    /// Broadcast calls.
    pub broadcasts: u64,
    /// Barrier calls.
    pub barriers: u64,
    /// Bytes of tensors all-reduced or broadcast.
    pub bytes: u64,
}

/// One rank's member of a c10d process group. Collectives take `&mut self`:
/// every rank must issue the same collectives in the same order, which one
/// owner (movable across threads, never shared) makes easy to keep.
pub struct ProcessGroup {
    raw: *mut ffi::RawGroup,
    backend: Backend,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Where this group's tensors must live: the CPU for Gloo, the rank's GPU for NCCL.
    device: Device,
    stats: CommStats,
    /// Collectives entered (the next one's number).
    entered: u64,
    /// Who hears of each collective (the rank's heartbeat).
    observer: Option<Arc<dyn CollectiveObserver>>,
}

// SAFETY: the shim's group holds only thread-safe c10d objects (the store and
// backend are reference-counted and internally synchronised); `ProcessGroup`
// owns its handle exclusively and is not `Sync`, so one thread at a time uses it.
unsafe impl Send for ProcessGroup {}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("backend", &self.backend)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ProcessGroup {
    /// Rendezvous at `master_addr:master_port` (rank 0 serves the store) and
    /// build the backend. Fails after `timeout`, naming the ranks that never
    /// joined, rather than hanging.
    pub fn new(options: &GroupOptions) -> Result<Self, DistError> {
        let init_error = |message: String| DistError::Init {
            rank: options.rank,
            world: options.world_size,
            backend: options.backend.name(),
            master: format!("{}:{}", options.master_addr, options.master_port),
            message,
        };
        if options.world_size == 0 || options.rank >= options.world_size {
            return Err(DistError::Options(format!(
                "rank {} is not in 0..{} (world size)",
                options.rank, options.world_size
            )));
        }
        if options.backend == Backend::Nccl && !nccl_available() {
            return Err(init_error(
                "this build has no NCCL backend (CUDA/NCCL headers were not found when \
                 the c10d shim was compiled); use gloo"
                    .into(),
            ));
        }
        let to_c_int = |value: usize, what: &str| {
            c_int::try_from(value)
                .map_err(|_| DistError::Options(format!("{what} {value} does not fit a C int")))
        };
        let rank = to_c_int(options.rank, "rank")?;
        let world = to_c_int(options.world_size, "world size")?;
        let device = to_c_int(options.device_index, "device index")?;
        let timeout_ms = timeout_millis(options.timeout)?;
        let master = CString::new(options.master_addr.as_str())
            .map_err(|_| DistError::Options("MASTER_ADDR contains a NUL byte".into()))?;
        let prefix = CString::new(options.prefix.as_str())
            .map_err(|_| DistError::Options("group prefix contains a NUL byte".into()))?;
        let mut raw: *mut ffi::RawGroup = std::ptr::null_mut();
        // SAFETY: the strings are NUL-terminated and live across the call; `raw`
        // is a valid out-pointer; the shim catches every C++ exception.
        let status = unsafe {
            ffi::vs_group_new(
                options.backend.code(),
                master.as_ptr(),
                options.master_port,
                rank,
                world,
                timeout_ms,
                prefix.as_ptr(),
                device,
                &mut raw,
            )
        };
        ffi::take_error(status).map_err(init_error)?;
        if raw.is_null() {
            return Err(init_error("the shim returned no group".into()));
        }
        tracing::debug!(
            rank = options.rank,
            world = options.world_size,
            backend = options.backend.name(),
            "process group ready"
        );
        Ok(ProcessGroup {
            raw,
            backend: options.backend,
            rank: options.rank,
            world_size: options.world_size,
            timeout: options.timeout,
            device: collective_device(options.backend, options.device_index),
            stats: CommStats::default(),
            entered: 0,
            observer: None,
        })
    }

    /// Tells `observer` of every collective from now on.
    pub fn observe(&mut self, observer: Arc<dyn CollectiveObserver>) {
        self.observer = Some(observer);
    }

    /// Who hears of this group's collectives (and of the Reducer's buckets).
    pub(crate) fn observer(&self) -> Option<Arc<dyn CollectiveObserver>> {
        self.observer.clone()
    }

    /// The number the next collective this rank enters will get.
    pub(crate) fn next_seq(&self) -> u64 {
        self.entered
    }

    /// Numbers the collective this rank enters now and tells the observer.
    fn enter(&mut self, op: CollectiveOp) -> u64 {
        let seq = self.entered;
        self.entered += 1;
        if let Some(observer) = &self.observer {
            observer.entered(op, seq);
        }
        seq
    }

    /// Tells the observer that collective `seq` completed.
    fn complete(&self, seq: u64) {
        if let Some(observer) = &self.observer {
            observer.completed(seq);
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The communication library.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Where the tensors of this group's collectives live: the CPU for Gloo, the
    /// rank's GPU for NCCL (which refuses host tensors).
    pub fn device(&self) -> Device {
        self.device
    }

    /// All-reduces `values` kept on the host (counts, flags, metrics): they travel
    /// to [`Self::device`] and back, so the same call serves Gloo and NCCL.
    pub fn all_reduce_host(&mut self, values: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        let rank = self.rank;
        let tensor_error = move |e: tch::TchError| DistError::Tensor {
            rank,
            op: "all_reduce_host",
            message: e.to_string(),
        };
        let mut on_device = values
            .f_to_device(self.device)
            .and_then(|t| t.f_contiguous())
            .map_err(tensor_error)?;
        self.all_reduce(&mut on_device, op)?;
        on_device.f_to_device(Device::Cpu).map_err(tensor_error)
    }

    /// Longest wait of any collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Collectives run so far.
    pub fn stats(&self) -> CommStats {
        self.stats
    }

    /// Reduces `tensor` across ranks, in place: every rank ends with the result.
    /// The tensor must be dense and contiguous, on the CPU for Gloo and on this
    /// rank's CUDA device for NCCL.
    pub fn all_reduce(&mut self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), DistError> {
        self.check_device(tensor, "all_reduce")?;
        let bytes = tensor_bytes(tensor);
        let ptr = tensor.as_mut_ptr() as *mut c_void;
        self.run_collective(CollectiveOp::AllReduce, |raw| {
            // SAFETY: `ptr` points to the `at::Tensor` that `tensor` owns, which
            // outlives the call; the shim waits for completion before returning.
            unsafe { ffi::vs_group_allreduce(raw, ptr, op.code()) }
        })?;
        self.stats.bytes += bytes;
        Ok(())
    }

    /// Overwrites `tensor` on every rank with `root`'s, in place.
    pub fn broadcast(&mut self, tensor: &mut Tensor, root: usize) -> Result<(), DistError> {
        let root = c_int::try_from(root)
            .map_err(|_| DistError::Options(format!("root rank {root} does not fit a C int")))?;
        self.check_device(tensor, "broadcast")?;
        let bytes = tensor_bytes(tensor);
        let ptr = tensor.as_mut_ptr() as *mut c_void;
        self.run_collective(CollectiveOp::Broadcast, |raw| {
            // SAFETY: as in `all_reduce`.
            unsafe { ffi::vs_group_broadcast(raw, ptr, root) }
        })?;
        self.stats.bytes += bytes;
        Ok(())
    }

    /// Returns once every rank has entered the barrier (or fails on time-out).
    pub fn barrier(&mut self) -> Result<(), DistError> {
        self.run_collective(CollectiveOp::Barrier, |raw| {
            // SAFETY: `raw` is the live group handle owned by `self`.
            unsafe { ffi::vs_group_barrier(raw) }
        })
    }

    /// Runs one collective through the shim, `call` given this group's handle:
    /// numbered, observed, counted once as `op` and failing as a named
    /// [`DistError::Collective`]. The Reducer's broadcast at start and its
    /// gradient all-reduces inside backward go through here too.
    pub(crate) fn run_collective(
        &mut self,
        op: CollectiveOp,
        call: impl FnOnce(*mut ffi::RawGroup) -> *mut std::ffi::c_char,
    ) -> Result<(), DistError> {
        let seq = self.enter(op);
        let status = call(self.raw);
        let name = match op {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Barrier => "barrier",
        };
        self.finish(name, status)?;
        self.complete(seq);
        match op {
            CollectiveOp::AllReduce => self.stats.all_reduces += 1,
            CollectiveOp::Broadcast => self.stats.broadcasts += 1,
            CollectiveOp::Barrier => self.stats.barriers += 1,
        }
        Ok(())
    }

    /// Refuses, naming the collective and both devices, a tensor that NCCL cannot
    /// take (its own message, "Tensors must be CUDA and dense", names neither).
    /// Gloo takes host tensors and stages CUDA ones itself.
    fn check_device(&self, tensor: &Tensor, op: &'static str) -> Result<(), DistError> {
        if self.backend == Backend::Gloo {
            return Ok(());
        }
        device_matches(tensor.device(), self.device).map_err(|message| self.failed(op, message))
    }

    fn seq(&self) -> u64 {
        self.stats.all_reduces + self.stats.broadcasts + self.stats.barriers
    }

    /// A failure of `op`, the collective about to run or running, naming this rank,
    /// the world, the collective's number and the backend.
    fn failed(&self, op: &'static str, message: String) -> DistError {
        DistError::Collective {
            rank: self.rank,
            world: self.world_size,
            op,
            seq: self.seq(),
            backend: self.backend.name(),
            message,
        }
    }

    fn finish(&self, op: &'static str, status: *mut std::ffi::c_char) -> Result<(), DistError> {
        ffi::take_error(status).map_err(|message| self.failed(op, message))
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `vs_group_new`, is non-null, and is freed once.
        unsafe { ffi::vs_group_free(self.raw) };
    }
}

/// The device a backend's collectives take their tensors on.
fn collective_device(backend: Backend, device_index: usize) -> Device {
    match backend {
        Backend::Gloo => Device::Cpu,
        Backend::Nccl => Device::Cuda(device_index),
    }
}

/// `Ok` when a tensor on `tensor` can go to a collective working on `group`.
fn device_matches(tensor: Device, group: Device) -> Result<(), String> {
    if tensor == group {
        return Ok(());
    }
    Err(format!(
        "the tensor is on {} but this group's collectives work on {} (host values go \
         through all_reduce_host)",
        device_name(tensor),
        device_name(group)
    ))
}

fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}"),
    }
}

fn timeout_millis(timeout: Duration) -> Result<i64, DistError> {
    let ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
    if ms == 0 {
        return Err(DistError::Options("timeout must be at least 1 ms".into()));
    }
    Ok(ms)
}

fn tensor_bytes(tensor: &Tensor) -> u64 {
    let elements = tensor.numel() as u64;
    elements * tensor.kind().elt_size_in_bytes() as u64
}

/// Gives `param` a zero gradient if it has none (a parameter unused this
/// step), so every rank flattens the same gradient layout.
pub(crate) fn ensure_grad(param: &mut Tensor) -> Result<(), String> {
    let ptr = param.as_mut_ptr() as *mut c_void;
    // SAFETY: `ptr` points to the live `at::Tensor` owned by `param`; the shim
    // only sets its autograd `grad` field when undefined.
    ffi::take_error(unsafe { ffi::vs_ensure_grad(ptr) })
}

/// A free TCP port on loopback (bound, then released), for unit tests.
#[cfg(test)]
pub(crate) fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// A Gloo group of one rank on a free loopback port, for unit tests.
#[cfg(test)]
pub(crate) fn gloo_world_of_one() -> ProcessGroup {
    let options = GroupOptions {
        backend: Backend::Gloo,
        master_addr: "127.0.0.1".into(),
        master_port: free_port(),
        rank: 0,
        world_size: 1,
        timeout: Duration::from_secs(10),
        prefix: "unit".into(),
        device_index: 0,
    };
    ProcessGroup::new(&options).expect("world of one")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_rank_group_reduces_to_itself() {
        let mut group = gloo_world_of_one();
        let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        group.all_reduce(&mut t, ReduceOp::Avg).expect("avg");
        assert_eq!(Vec::<f32>::try_from(&t).expect("f32"), vec![1.0, 2.0, 3.0]);
        let seen = Arc::new(Seen::default());
        group.observe(seen.clone());
        group.barrier().expect("barrier");
        assert_eq!(
            *seen.0.lock().expect("lock"),
            ["enter barrier #1", "done #1"],
            "numbered from the first collective, observed or not"
        );
        assert_eq!(group.stats().all_reduces, 1);
        assert_eq!(group.stats().barriers, 1);
        assert_eq!(group.stats().bytes, 12);
    }

    /// NCCL takes only tensors on the rank's GPU: the host values of the shape check
    /// and the trainer's flags failed there with NCCL's "Tensors must be CUDA and
    /// dense" (seen on an H100). Host values travel through `all_reduce_host`, and a
    /// tensor on the wrong device is refused naming both devices.
    #[test]
    fn nccl_collectives_work_on_the_ranks_gpu_and_gloo_on_the_host() {
        assert_eq!(collective_device(Backend::Gloo, 3), Device::Cpu);
        assert_eq!(collective_device(Backend::Nccl, 3), Device::Cuda(3));
        assert!(device_matches(Device::Cuda(1), Device::Cuda(1)).is_ok());
        let err = device_matches(Device::Cpu, Device::Cuda(1)).expect_err("host tensor");
        assert!(err.contains("on cpu") && err.contains("cuda:1"), "{err}");
        let err = device_matches(Device::Cuda(0), Device::Cuda(1)).expect_err("other GPU");
        assert!(err.contains("cuda:0") && err.contains("cuda:1"), "{err}");

        let mut group = gloo_world_of_one();
        assert_eq!(group.device(), Device::Cpu);
        let summed = group
            .all_reduce_host(&Tensor::from_slice(&[2i64, 5]), ReduceOp::Sum)
            .expect("host all-reduce");
        assert_eq!(summed.device(), Device::Cpu);
        assert_eq!(Vec::<i64>::try_from(&summed).expect("i64"), vec![2, 5]);
    }

    #[test]
    fn bad_rank_and_integer_average_are_errors() {
        let options = GroupOptions {
            backend: Backend::Gloo,
            master_addr: "127.0.0.1".into(),
            master_port: free_port(),
            rank: 2,
            world_size: 2,
            timeout: Duration::from_secs(1),
            prefix: "unit".into(),
            device_index: 0,
        };
        let err = ProcessGroup::new(&options).expect_err("rank 2 of 2");
        assert!(err.to_string().contains("rank 2 is not in 0..2"), "{err}");

        let options = GroupOptions {
            rank: 0,
            world_size: 1,
            ..options
        };
        let mut group = ProcessGroup::new(&options).expect("world of one");
        let mut ints = Tensor::from_slice(&[1i64, 2]);
        let err = group
            .all_reduce(&mut ints, ReduceOp::Avg)
            .expect_err("int avg");
        let text = err.to_string();
        assert!(text.contains("rank 0 of 1: all_reduce #0 (gloo)"), "{text}");
        assert!(text.contains("floating-point"), "{text}");
    }

    #[test]
    fn nccl_without_support_or_gpu_is_a_clear_error() {
        let options = GroupOptions {
            backend: Backend::Nccl,
            master_addr: "127.0.0.1".into(),
            master_port: free_port(),
            rank: 0,
            world_size: 1,
            timeout: Duration::from_secs(5),
            prefix: "unit".into(),
            device_index: 0,
        };
        if tch::Cuda::is_available() {
            return; // a GPU machine: the NCCL path is exercised elsewhere
        }
        let err = ProcessGroup::new(&options).expect_err("no GPU");
        let text = err.to_string();
        assert!(
            text.contains("no NCCL backend") || text.contains("needs a CUDA device"),
            "{text}"
        );
    }

    #[test]
    fn options_follow_the_ranks_decided_device() {
        use vrtspike_contract::env::{Device, Rendezvous};
        let mut env = RankEnv {
            rank: 1,
            world_size: 2,
            local_rank: 0,
            local_world_size: 2,
            device: Device::Cuda(1),
            master: Some(Rendezvous {
                addr: "10.0.0.1".into(),
                port: 29400,
            }),
            ..RankEnv::single()
        };
        let timeout = Duration::from_secs(3);
        let options = GroupOptions::for_rank(&env, Backend::Nccl, timeout).expect("options");
        assert_eq!(options.device_index, 1, "the model's GPU, not LOCAL_RANK");
        assert_eq!((options.rank, options.world_size), (1, 2));
        assert_eq!(
            (options.master_addr.as_str(), options.master_port),
            ("10.0.0.1", 29400)
        );
        env.device = Device::Cpu;
        let err = GroupOptions::for_rank(&env, Backend::Nccl, timeout).expect_err("cpu nccl");
        assert!(err.to_string().contains("needs a CUDA device"), "{err}");
        env.master = None;
        let err = GroupOptions::for_rank(&env, Backend::Gloo, timeout).expect_err("no master");
        assert!(err.to_string().contains("MASTER_ADDR"), "{err}");
    }

    /// Records what a group says of its collectives.
    #[derive(Default)]
    struct Seen(std::sync::Mutex<Vec<String>>);

    impl CollectiveObserver for Seen {
        fn entered(&self, op: CollectiveOp, seq: u64) {
            if let Ok(mut seen) = self.0.lock() {
                seen.push(format!("enter {} #{seq}", op.name()));
            }
        }
        fn completed(&self, seq: u64) {
            if let Ok(mut seen) = self.0.lock() {
                seen.push(format!("done #{seq}"));
            }
        }
    }
}
