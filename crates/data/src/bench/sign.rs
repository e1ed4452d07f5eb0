//! `vrtspike bench sign`: what signing a dataset costs (the walk that keys a
//! node-shared cache server, `vrtspike_contract::dataset_sig`) on a tree of many
//! small files laid out like a dataset (`train/<seq>/<frame>`): the first
//! signature after the tree was written, then the best and median of a few more
//! (the page cache warm), with the walk's threads, and once with a budget too
//! short for the tree, which shows the fallback's time and that it is taken.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use vrtspike_contract::dataset_sig::{self, Coverage, SignOptions};

/// What to run.
#[derive(Debug, Clone)]
pub struct SignBenchOptions {
    /// Files in the tree.
    pub files: usize,
    /// Files per sequence folder.
    pub per_folder: usize,
    /// Where the tree goes (a fresh folder under it); `None`: the temp folder.
    pub under: Option<PathBuf>,
    /// Signatures after the first.
    pub repeats: usize,
    /// Threads of the walk (`None`: the default).
    pub threads: Option<usize>,
    /// The budget of the last run, which the tree should overrun.
    pub short_budget: Duration,
}

/// One signature's time and what it covered.
#[derive(Debug, Clone, Serialize)]
pub struct Signed {
    pub seconds: f64,
    pub files: u64,
    pub coverage: String,
}

/// What `bench sign` measured.
#[derive(Debug, Clone, Serialize)]
pub struct SignBenchReport {
    pub files: usize,
    pub folders: usize,
    pub threads: usize,
    /// Seconds to write the tree.
    pub write_s: f64,
    /// The first signature after the tree was written.
    pub first: Signed,
    /// The best and the median of the repeats.
    pub best_s: f64,
    pub median_s: f64,
    /// Files a second at the median.
    pub files_per_s: f64,
    /// With [`SignBenchOptions::short_budget`]: the fallback's time.
    pub short_budget_s: f64,
    pub over_budget: Signed,
}

impl std::fmt::Display for SignBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "sign bench: {} files in {} folders ({} threads), written in {:.2} s",
            self.files, self.folders, self.threads, self.write_s
        )?;
        writeln!(
            f,
            "  first signature {:.3} s; then best {:.3} s, median {:.3} s ({:.0} files/s)",
            self.first.seconds, self.best_s, self.median_s, self.files_per_s
        )?;
        write!(
            f,
            "  with a {:.3} s budget: {} in {:.3} s ({} files read)",
            self.short_budget_s,
            self.over_budget.coverage,
            self.over_budget.seconds,
            self.over_budget.files
        )
    }
}

/// Writes the tree, signs it as the options say, and removes it.
pub fn run(options: &SignBenchOptions) -> Result<SignBenchReport> {
    let parent = options.under.clone().unwrap_or_else(std::env::temp_dir);
    let tmp = tempfile::Builder::new()
        .prefix("vrtspike-bench-sign-")
        .tempdir_in(&parent)
        .with_context(|| format!("making the bench's folder in {}", parent.display()))?;
    let root = tmp.path().join("data");
    let started = Instant::now();
    let folders = write_tree(&root, options.files, options.per_folder.max(1))?;
    let write_s = started.elapsed().as_secs_f64();
    let defaults = SignOptions::from_env().map_err(anyhow::Error::msg)?;
    let full = SignOptions {
        threads: options.threads.unwrap_or(defaults.threads),
        budget: Duration::from_secs(3600),
    };
    let first = sign(&root, &full)?;
    let mut times = Vec::with_capacity(options.repeats);
    for _ in 0..options.repeats.max(1) {
        times.push(sign(&root, &full)?.seconds);
    }
    times.sort_by(f64::total_cmp);
    let median_s = times[times.len() / 2];
    let short = SignOptions {
        budget: options.short_budget,
        ..full
    };
    let over_budget = sign(&root, &short)?;
    Ok(SignBenchReport {
        files: options.files,
        folders,
        threads: full.threads,
        write_s,
        first,
        best_s: times[0],
        median_s,
        files_per_s: options.files as f64 / median_s.max(1e-9),
        short_budget_s: options.short_budget.as_secs_f64(),
        over_budget,
    })
}

/// One timed signature.
fn sign(root: &Path, options: &SignOptions) -> Result<Signed> {
    let started = Instant::now();
    let signature = dataset_sig::sign_with(root, options)?;
    let coverage = match &signature.coverage {
        Coverage::Full => "full".to_string(),
        Coverage::Shallow { .. } => "shallow (budget spent)".to_string(),
    };
    Ok(Signed {
        seconds: started.elapsed().as_secs_f64(),
        files: signature.tally.files,
        coverage,
    })
}

/// `files` small files under `root/train/<seq>/`, `per_folder` to a folder, and
/// a `dataset.yaml`; returns the number of sequence folders.
fn write_tree(root: &Path, files: usize, per_folder: usize) -> Result<usize> {
    let train = root.join("train");
    std::fs::create_dir_all(&train).with_context(|| format!("making {}", train.display()))?;
    std::fs::write(root.join("dataset.yaml"), "bench: sign\n")
        .with_context(|| format!("writing into {}", root.display()))?;
    let folders = files.div_ceil(per_folder);
    for folder in 0..folders {
        let seq = train.join(format!("seq{folder:05}"));
        std::fs::create_dir(&seq).with_context(|| format!("making {}", seq.display()))?;
        let here = per_folder.min(files - folder * per_folder);
        for frame in 0..here {
            let file = seq.join(format!("{frame:06}.png"));
            std::fs::write(&file, frame.to_le_bytes())
                .with_context(|| format!("writing {}", file.display()))?;
        }
    }
    Ok(folders)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_tree_is_signed_in_full_and_a_spent_budget_falls_back() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let report = run(&SignBenchOptions {
            files: 250,
            per_folder: 100,
            under: Some(dir.path().to_path_buf()),
            repeats: 2,
            threads: Some(2),
            short_budget: Duration::ZERO,
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(report.folders, 3);
        // Every file and the dataset.yaml.
        assert_eq!(report.first.files, 251);
        assert_eq!(report.first.coverage, "full");
        assert!(report.best_s <= report.median_s);
        assert_eq!(report.over_budget.coverage, "shallow (budget spent)");
        // Removed afterwards.
        let left = std::fs::read_dir(dir.path())
            .map(|d| d.count())
            .unwrap_or(1);
        assert_eq!(left, 0);
    }
}
