//! A benchmark's worker process, for the cache and loader benchmarks alike: this
//! binary run with a hidden `bench` subcommand and its options as JSON, read line by
//! line from its stdout (its last line is its report), killed if dropped early.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::testkit::process::ChildGuard;

/// A child process of a benchmark that could not be run or failed.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {message}")]
pub struct ProcessError {
    /// Which process, doing what.
    pub what: String,
    /// What happened.
    pub message: String,
}

impl ProcessError {
    /// `what` failed with `e`.
    pub fn new(what: impl Into<String>, e: impl std::fmt::Display) -> ProcessError {
        ProcessError {
            what: what.into(),
            message: e.to_string(),
        }
    }
}

/// A running worker process and its pipes.
pub struct Worker {
    /// Its name in errors (`bench worker 1`, `loader rank 0`).
    name: String,
    child: ChildGuard,
    lines: BufReader<ChildStdout>,
    stdin: Option<ChildStdin>,
}

impl Worker {
    /// Runs `exe bench <subcommand> --options <options as JSON>`, its stdin a pipe
    /// for [`Worker::tell`].
    pub fn start(
        exe: &Path,
        subcommand: &str,
        name: String,
        options: &impl Serialize,
    ) -> Result<Worker, ProcessError> {
        let json = serde_json::to_string(options)
            .map_err(|e| ProcessError::new(format!("{name}: options"), e))?;
        let mut child = Command::new(exe)
            .args(["bench", subcommand, "--options", &json])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| ProcessError::new(format!("starting {name}"), e))?;
        let (stdout, stdin) = (child.stdout.take(), child.stdin.take());
        let child = ChildGuard(child);
        let stdout = stdout.ok_or_else(|| ProcessError::new(&name, "no stdout"))?;
        Ok(Worker {
            name,
            child,
            lines: BufReader::new(stdout),
            stdin,
        })
    }

    /// The worker's next line, trimmed; an error once it closed its stdout.
    pub fn line(&mut self) -> Result<String, ProcessError> {
        let mut line = String::new();
        let n = self
            .lines
            .read_line(&mut line)
            .map_err(|e| ProcessError::new(format!("reading {}", self.name), e))?;
        if n == 0 {
            let status = self.child.0.wait();
            return Err(ProcessError::new(
                &self.name,
                format!("ended without a report ({status:?})"),
            ));
        }
        Ok(line.trim().to_string())
    }

    /// Parses `line` as the worker's report.
    pub fn report<R: DeserializeOwned>(&self, line: &str) -> Result<R, ProcessError> {
        serde_json::from_str(line)
            .map_err(|e| ProcessError::new(format!("{} report {line:?}", self.name), e))
    }

    /// Writes `word` and a newline to the worker's stdin.
    pub fn tell(&mut self, word: &str) -> Result<(), ProcessError> {
        if let Some(stdin) = &mut self.stdin {
            writeln!(stdin, "{word}")
                .and_then(|()| stdin.flush())
                .map_err(|e| ProcessError::new(format!("telling {}", self.name), e))?;
        }
        Ok(())
    }

    /// Reads the rest of its output, closes its stdin and waits for it: an error
    /// unless it exited with success.
    pub fn finish(mut self) -> Result<(), ProcessError> {
        let mut rest = String::new();
        let _ = self.lines.read_to_string(&mut rest);
        self.stdin = None;
        let status = self
            .child
            .0
            .wait()
            .map_err(|e| ProcessError::new(format!("waiting for {}", self.name), e))?;
        match status.success() {
            true => Ok(()),
            false => Err(ProcessError::new(&self.name, status)),
        }
    }

    /// Its one line, parsed as its report, once it exited with success.
    pub fn only_report<R: DeserializeOwned>(mut self) -> Result<R, ProcessError> {
        let line = self.line()?;
        let report = self.report(&line);
        self.finish()?;
        report
    }
}
