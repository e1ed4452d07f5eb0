//! The ranks' heartbeat: each rank keeps one fixed-size record,
//! `<run dir>/heartbeat/rank<R>`, saying which step it is at, in which phase
//! (data, forward, backward, all-reduce, ...), since when (unix time), in which
//! attempt, how far it got in the process group's collectives (the sequence
//! number of the last one entered and completed, and its kind; inside the
//! Reducer's gradient all-reduce, which spans a whole backward pass, also the
//! gradient buckets it has launched), and a liveness
//! tick: a counter that a thread of its own advances about twice a second. A
//! stopped or wedged process stops ticking; a rank waiting in a collective for a
//! stopped peer keeps ticking, which is how the launcher tells the two apart (the
//! way NCCL's watchdog and flight recorder do). The rank rewrites the record in
//! place (one `pwrite` of [`RECORD_LEN`] bytes); the launcher reads it. A checksum
//! in the record lets the reader tell a torn read from a record. The launcher's
//! stack dumps of a hung job live beside it (`stacks/attempt<K>/rank<R>.txt`).

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The directory of the heartbeat records, under the run directory.
pub const HEARTBEAT_DIR: &str = "heartbeat";
/// The directory of the stacks the launcher saves when it finds a hung rank.
pub const STACKS_DIR: &str = "stacks";
/// Bytes of one record (text padded with spaces, ending in a newline).
pub const RECORD_LEN: usize = 256;
/// The first word of every record (the format's version).
const MAGIC: &str = "vrtspike-heartbeat-v3";
/// How often a rank's liveness thread advances its tick.
pub const TICK_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// Where a rank is in its loop. The order of the variants is the order of
/// progress within one step count: validation and checkpoint run after step `S`
/// finished (with `S` steps done), then step `S`'s successor starts with data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Starting: data, model, resume, rendezvous.
    Start,
    /// Validation after a step.
    Validation,
    /// Writing a checkpoint (and the barrier after it).
    Checkpoint,
    /// Waiting for the next batch.
    Data,
    /// Forward pass.
    Forward,
    /// Backward pass.
    Backward,
    /// Averaging gradients and step figures over ranks.
    AllReduce,
    /// The optimizer update.
    Optimizer,
}

impl Phase {
    /// Every phase, in progress order.
    pub const ALL: [Phase; 8] = [
        Phase::Start,
        Phase::Validation,
        Phase::Checkpoint,
        Phase::Data,
        Phase::Forward,
        Phase::Backward,
        Phase::AllReduce,
        Phase::Optimizer,
    ];

    /// Its name in records and messages (`allreduce`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Start => "start",
            Phase::Validation => "validation",
            Phase::Checkpoint => "checkpoint",
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::AllReduce => "allreduce",
            Phase::Optimizer => "optimizer",
        }
    }

    /// The phase of a name.
    pub fn parse(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == name)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How far a rank got: steps done and the phase it is in. Ordered by progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Progress {
    /// Optimizer steps done.
    pub step: u64,
    /// Where in the loop.
    pub phase: Phase,
}

/// A collective of the process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    /// All-reduce (gradients, step figures).
    AllReduce,
    /// Broadcast (parameters at start).
    Broadcast,
    /// Barrier (after a checkpoint).
    Barrier,
}

impl CollectiveOp {
    /// Every kind.
    pub const ALL: [CollectiveOp; 3] = [
        CollectiveOp::AllReduce,
        CollectiveOp::Broadcast,
        CollectiveOp::Barrier,
    ];

    /// Its name in records and messages (`all_reduce`, the name the process
    /// group's errors use).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Barrier => "barrier",
        }
    }

    /// The kind of a name.
    pub fn parse(name: &str) -> Option<CollectiveOp> {
        CollectiveOp::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// How far a rank got in its process group's collectives: they are numbered
/// from 0 in the order every rank issues them, so a rank inside collective `#k`
/// has entered `k + 1` and completed `k`. The Reducer's gradient all-reduce is
/// one collective for a whole backward pass, entered before any gradient exists:
/// how far a rank got inside it is the gradient buckets it has launched, so a rank
/// wedged in backward (fewer) is told from its peers waiting for its buckets (all).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Collectives {
    /// Collectives entered.
    pub entered: u64,
    /// Collectives completed.
    pub completed: u64,
    /// The kind of the last one entered.
    pub last: Option<CollectiveOp>,
    /// Gradient buckets launched inside the last collective entered (0 for any
    /// other than the Reducer's).
    pub buckets: u32,
}

impl Collectives {
    /// The number of the collective the rank is inside, if it is inside one.
    pub fn inside(&self) -> Option<u64> {
        (self.entered > self.completed).then(|| self.entered - 1)
    }

    /// `inside all_reduce #128`, `inside all_reduce #128 (3 gradient buckets
    /// launched)`, `last all_reduce #127 done`, `no collective yet`.
    pub fn describe(&self) -> String {
        let op = self.last.map_or("collective", CollectiveOp::name);
        match (self.inside(), self.entered) {
            (Some(seq), _) if self.buckets > 0 => format!(
                "inside {op} #{seq} ({} gradient bucket{} launched)",
                self.buckets,
                if self.buckets == 1 { "" } else { "s" }
            ),
            (Some(seq), _) => format!("inside {op} #{seq}"),
            (None, 0) => "no collective yet".to_string(),
            (None, entered) => format!("last {op} #{} done", entered - 1),
        }
    }
}

/// One heartbeat record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// Step and phase.
    pub progress: Progress,
    /// When the rank entered the phase, in milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The attempt (restart count) of the rank that wrote it.
    pub attempt: u32,
    /// The writer's pid.
    pub pid: u32,
    /// The liveness tick: advanced by a thread of the rank's own every
    /// [`TICK_INTERVAL`]; only whether it changes matters.
    pub tick: u64,
    /// The process group's collectives.
    pub collectives: Collectives,
}

/// A heartbeat that cannot be written or read (the file named).
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    /// The file could not be created, written or read.
    #[error("heartbeat {path}: {source}")]
    Io {
        /// The record's file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// The file holds no valid record (torn read or another format).
    #[error("heartbeat {path}: not a valid record ({reason})")]
    Invalid {
        /// The record's file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// The record of rank `rank` under `run_dir`.
pub fn path(run_dir: &Path, rank: u32) -> PathBuf {
    run_dir.join(HEARTBEAT_DIR).join(format!("rank{rank}"))
}

/// The launcher's record of a lost node beside the ranks' records,
/// `<run dir>/heartbeat/node<K>.lost`: one line, the unix time in milliseconds
/// and the cause (`node 1 (host vn2) silent for 30 s: lost`).
pub fn lost_node_path(run_dir: &Path, node: u32) -> PathBuf {
    run_dir.join(HEARTBEAT_DIR).join(format!("node{node}.lost"))
}

/// For `map_err`: an I/O failure on the record file `path`.
fn io_error(path: &Path) -> impl Fn(std::io::Error) -> HeartbeatError + '_ {
    move |source| HeartbeatError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Makes the folder of the record file `path`.
fn create_parent(path: &Path) -> Result<(), HeartbeatError> {
    match path.parent() {
        Some(dir) => std::fs::create_dir_all(dir).map_err(io_error(path)),
        None => Ok(()),
    }
}

/// Writes the record of lost node `node` (see [`lost_node_path`]).
pub fn write_lost_node(run_dir: &Path, node: u32, cause: &str) -> Result<(), HeartbeatError> {
    let path = lost_node_path(run_dir, node);
    create_parent(&path)?;
    let line = format!("unix_ms={} {}\n", unix_ms_now(), cause.replace('\n', " "));
    std::fs::write(&path, line).map_err(io_error(&path))
}

/// The lost nodes recorded under `run_dir`, by node, with their causes.
pub fn read_lost_nodes(run_dir: &Path) -> Result<Vec<(u32, String)>, HeartbeatError> {
    let dir = run_dir.join(HEARTBEAT_DIR);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(HeartbeatError::Io { path: dir, source }),
    };
    let mut lost = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(node) = name
            .strip_prefix("node")
            .and_then(|rest| rest.strip_suffix(".lost"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path();
        let text =
            std::fs::read_to_string(&path).map_err(|source| HeartbeatError::Io { path, source })?;
        let cause = text.trim_end().split_once(' ').map_or("", |(_, c)| c);
        lost.push((node, cause.to_string()));
    }
    lost.sort();
    Ok(lost)
}

/// Where the launcher saves rank `rank`'s stacks when attempt `attempt` hangs.
pub fn stacks_path(run_dir: &Path, attempt: u32, rank: u32) -> PathBuf {
    run_dir
        .join(STACKS_DIR)
        .join(format!("attempt{attempt}"))
        .join(format!("rank{rank}.txt"))
}

/// Milliseconds since the Unix epoch now.
pub fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Beat {
    /// The record's bytes: one line of text padded to [`RECORD_LEN`].
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let c = &self.collectives;
        let body = format!(
            "{MAGIC} step={} phase={} unix_ms={} attempt={} pid={} tick={} coll={}/{} op={} bw={}",
            self.progress.step,
            self.progress.phase,
            self.unix_ms,
            self.attempt,
            self.pid,
            self.tick,
            c.entered,
            c.completed,
            c.last.map_or("-", CollectiveOp::name),
            c.buckets
        );
        let line = format!("{body} sum={:08x}", checksum(body.as_bytes()));
        let mut record = [b' '; RECORD_LEN];
        // The longest line (every number at its maximum) is 247 bytes.
        let len = line.len().min(RECORD_LEN - 1);
        record[..len].copy_from_slice(&line.as_bytes()[..len]);
        record[RECORD_LEN - 1] = b'\n';
        record
    }

    /// Parses a record; the error says what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Beat, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| "not UTF-8".to_string())?;
        let line = text.trim_end();
        let (body, sum) = line.rsplit_once(" sum=").ok_or("no checksum")?;
        let sum = u32::from_str_radix(sum, 16).map_err(|_| format!("bad checksum {sum:?}"))?;
        if sum != checksum(body.as_bytes()) {
            return Err("checksum mismatch (torn or stale record)".into());
        }
        let mut words = body.split(' ');
        if words.next() != Some(MAGIC) {
            return Err(format!("does not start with {MAGIC}"));
        }
        let mut field = |key: &str| -> Result<&str, String> {
            let word = words.next().ok_or_else(|| format!("no {key}"))?;
            word.strip_prefix(key)
                .and_then(|w| w.strip_prefix('='))
                .ok_or_else(|| format!("expected {key}=, got {word:?}"))
        };
        let number = |key: &str, text: &str| -> Result<u64, String> {
            text.parse()
                .map_err(|_| format!("{key}: not a number: {text:?}"))
        };
        let step = number("step", field("step")?)?;
        let phase_name = field("phase")?;
        let phase =
            Phase::parse(phase_name).ok_or_else(|| format!("unknown phase {phase_name:?}"))?;
        let unix_ms = number("unix_ms", field("unix_ms")?)?;
        let attempt = number("attempt", field("attempt")?)?;
        let pid = number("pid", field("pid")?)?;
        let tick = number("tick", field("tick")?)?;
        let coll = field("coll")?;
        let (entered, completed) = coll
            .split_once('/')
            .ok_or_else(|| format!("coll: expected <entered>/<completed>, got {coll:?}"))?;
        let op = field("op")?;
        let last = match op {
            "-" => None,
            name => Some(CollectiveOp::parse(name).ok_or_else(|| format!("unknown op {name:?}"))?),
        };
        let buckets = number("bw", field("bw")?)?;
        Ok(Beat {
            progress: Progress { step, phase },
            unix_ms,
            attempt: u32::try_from(attempt).map_err(|_| "attempt out of range".to_string())?,
            pid: u32::try_from(pid).map_err(|_| "pid out of range".to_string())?,
            tick,
            collectives: Collectives {
                entered: number("entered", entered)?,
                completed: number("completed", completed)?,
                last,
                buckets: u32::try_from(buckets).map_err(|_| "bw out of range".to_string())?,
            },
        })
    }
}

/// The record's checksum: FNV-1a (32 bits) of `bytes`.
fn checksum(bytes: &[u8]) -> u32 {
    crate::fnv::fnv1a_32(bytes)
}

/// A rank's side: its record, open for rewriting in place.
#[derive(Debug)]
pub struct HeartbeatWriter {
    file: File,
    path: PathBuf,
}

impl HeartbeatWriter {
    /// Creates (or takes over) rank `rank`'s record under `run_dir`.
    pub fn create(run_dir: &Path, rank: u32) -> Result<Self, HeartbeatError> {
        let path = path(run_dir, rank);
        create_parent(&path)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&path)
            .map_err(io_error(&path))?;
        Ok(HeartbeatWriter { file, path })
    }

    /// Rewrites the record with `beat` (one `pwrite` of [`RECORD_LEN`] bytes).
    pub fn write(&self, beat: &Beat) -> Result<(), HeartbeatError> {
        self.file
            .write_all_at(&beat.encode(), 0)
            .map_err(io_error(&self.path))
    }

    /// Its file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The launcher's side: rank `rank`'s record under `run_dir`, `None` when the rank
/// has written none. A torn read (the rank rewriting it at that moment) is retried.
pub fn read(run_dir: &Path, rank: u32) -> Result<Option<Beat>, HeartbeatError> {
    let path = path(run_dir, rank);
    let mut last_reason = String::new();
    for _ in 0..3 {
        let mut bytes = Vec::with_capacity(RECORD_LEN);
        match File::open(&path) {
            Ok(file) => file
                .take(RECORD_LEN as u64)
                .read_to_end(&mut bytes)
                .map_err(io_error(&path))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(HeartbeatError::Io { path, source }),
        };
        if bytes.is_empty() {
            return Ok(None);
        }
        match Beat::decode(&bytes) {
            Ok(beat) => return Ok(Some(beat)),
            Err(reason) => last_reason = reason,
        }
    }
    Err(HeartbeatError::Invalid {
        path,
        reason: last_reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(step: u64, phase: Phase) -> Beat {
        Beat {
            progress: Progress { step, phase },
            unix_ms: 1_700_000_000_123,
            attempt: 2,
            pid: 4242,
            tick: 17,
            collectives: Collectives {
                entered: 129,
                completed: 128,
                last: Some(CollectiveOp::AllReduce),
                buckets: 3,
            },
        }
    }

    #[test]
    fn records_round_trip_at_a_fixed_size() {
        for phase in Phase::ALL {
            assert_eq!(Phase::parse(phase.name()), Some(phase));
            let b = beat(17, phase);
            let record = b.encode();
            assert_eq!(record.len(), RECORD_LEN);
            assert_eq!(Beat::decode(&record), Ok(b));
        }
        let widest = Beat {
            progress: Progress {
                step: u64::MAX,
                phase: Phase::Validation,
            },
            unix_ms: u64::MAX,
            attempt: u32::MAX,
            pid: u32::MAX,
            tick: u64::MAX,
            collectives: Collectives {
                entered: u64::MAX,
                completed: u64::MAX,
                last: Some(CollectiveOp::Broadcast),
                buckets: u32::MAX,
            },
        };
        let mut fresh = beat(0, Phase::Start);
        fresh.collectives = Collectives::default();
        assert_eq!(
            Beat::decode(&fresh.encode()),
            Ok(fresh),
            "no collective yet"
        );
        assert_eq!(
            Beat::decode(&widest.encode()),
            Ok(widest),
            "nothing cut off"
        );
    }

    #[test]
    fn torn_or_foreign_records_are_refused() {
        let mut record = beat(5, Phase::Forward).encode();
        // A torn write: the start of a newer record over the older one.
        let newer = beat(6, Phase::Data).encode();
        record[..40].copy_from_slice(&newer[..40]);
        assert!(Beat::decode(&record).is_err_and(|e| e.contains("checksum")));
        assert!(Beat::decode(b"hello").is_err());
        assert!(Beat::decode(&[0xff; RECORD_LEN]).is_err());
    }

    #[test]
    fn progress_orders_phases_within_a_step_count() {
        let p = |step, phase| Progress { step, phase };
        assert!(p(3, Phase::Forward) < p(3, Phase::AllReduce));
        assert!(p(3, Phase::Optimizer) < p(4, Phase::Validation));
        assert!(p(4, Phase::Checkpoint) < p(4, Phase::Data));
        assert!(p(0, Phase::Start) < p(0, Phase::Data));
    }

    #[test]
    fn collectives_say_where_the_rank_is() {
        let mut c = Collectives::default();
        assert_eq!(
            (c.inside(), c.describe().as_str()),
            (None, "no collective yet")
        );
        c = Collectives {
            entered: 129,
            completed: 128,
            last: Some(CollectiveOp::AllReduce),
            buckets: 0,
        };
        assert_eq!(
            (c.inside(), c.describe().as_str()),
            (Some(128), "inside all_reduce #128")
        );
        c.buckets = 3;
        assert_eq!(
            c.describe(),
            "inside all_reduce #128 (3 gradient buckets launched)"
        );
        c.buckets = 0;
        c.completed = 129;
        assert_eq!(
            (c.inside(), c.describe().as_str()),
            (None, "last all_reduce #128 done")
        );
    }

    #[test]
    fn the_writer_rewrites_in_place_and_the_reader_sees_the_last() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(read(tmp.path(), 1), Ok(None)), "no record yet");
        let writer = HeartbeatWriter::create(tmp.path(), 1).unwrap_or_else(|e| panic!("{e}"));
        let at = |step, phase| Progress { step, phase };
        writer
            .write(&beat(0, Phase::Start))
            .unwrap_or_else(|e| panic!("{e}"));
        writer
            .write(&beat(12, Phase::AllReduce))
            .unwrap_or_else(|e| panic!("{e}"));
        let got = read(tmp.path(), 1)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("no record"));
        assert_eq!(got.progress, at(12, Phase::AllReduce));
        assert_eq!((got.attempt, got.pid, got.tick), (2, 4242, 17));
        assert_eq!(
            std::fs::metadata(writer.path()).map(|m| m.len()).ok(),
            Some(RECORD_LEN as u64)
        );
        std::fs::write(path(tmp.path(), 2), b"garbage").unwrap_or_else(|e| panic!("{e}"));
        let err = read(tmp.path(), 2).map(|_| ()).map_err(|e| e.to_string());
        assert!(err.is_err_and(|e| e.contains("rank2") && e.contains("not a valid record")));
    }

    #[test]
    fn paths_live_under_the_run_dir() {
        let run = Path::new("/r");
        assert_eq!(path(run, 3), PathBuf::from("/r/heartbeat/rank3"));
        assert_eq!(
            stacks_path(run, 1, 3),
            PathBuf::from("/r/stacks/attempt1/rank3.txt")
        );
    }

    #[test]
    fn a_lost_node_is_recorded_beside_the_ranks_and_read_back_by_node() {
        let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(read_lost_nodes(tmp.path()).ok(), Some(Vec::new()));
        let writer = HeartbeatWriter::create(tmp.path(), 0).unwrap_or_else(|e| panic!("{e}"));
        writer
            .write(&beat(3, Phase::Data))
            .unwrap_or_else(|e| panic!("{e}"));
        for node in [2, 1] {
            let cause = format!("node {node} (host vn{}) silent for 30 s: lost", node + 1);
            write_lost_node(tmp.path(), node, &cause).unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(
            lost_node_path(tmp.path(), 1),
            tmp.path().join("heartbeat/node1.lost")
        );
        let lost = read_lost_nodes(tmp.path()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            lost,
            [
                (1, "node 1 (host vn2) silent for 30 s: lost".to_string()),
                (2, "node 2 (host vn3) silent for 30 s: lost".to_string()),
            ]
        );
        // The rank's record is untouched beside them.
        let rank0 = read(tmp.path(), 0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rank0.map(|b| b.progress.step), Some(3));
    }
}
