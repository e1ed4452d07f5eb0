//! The command line of what runs without libtorch, shared by the `vrtspike-cache`
//! binary and `vrtspike` (whose `cache`, `bench` and `h5-probe` subcommands these are): the
//! argument types, the glue from them to the library, and printing. Like the
//! binaries' own code it reports errors as `anyhow` with context; the library
//! modules below it do not.

pub mod bench;
pub mod cache;
pub mod h5_probe;
