//! Where a cache server listens when no one says: the one default of the launcher
//! contract ([`vrtspike_contract::cache_addr`]), with this process's user and a job.

use vrtspike_contract::cache_addr;

use super::ADDRESS_ENV;

/// The address of this user's cache server of `job`: `vrtspike-cache-u<uid>-<job>`.
pub fn default_address(job: &str) -> String {
    cache_addr::own_cache_address(job)
}

/// The address a tool uses: `explicit` if given, else `$VRTSPIKE_CACHE_ADDR` (set
/// by the launcher), else this user's server of the job it runs in (the SLURM job,
/// else `default`).
pub fn resolve(explicit: Option<&str>) -> String {
    let var = |name: &str| std::env::var(name).ok();
    explicit
        .map(str::to_owned)
        .or_else(|| var(ADDRESS_ENV).filter(|a| !a.is_empty()))
        .unwrap_or_else(|| default_address(&cache_addr::ambient_job(&var)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_address_wins_and_the_default_names_the_user() {
        assert_eq!(resolve(Some("mine")), "mine");
        let uid = nix::unistd::geteuid().as_raw();
        assert_eq!(default_address("j"), format!("vrtspike-cache-u{uid}-j"));
    }
}
