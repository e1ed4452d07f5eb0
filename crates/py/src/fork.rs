//! What one process made and only it may use or drop: a cache connection, a read
//! order and its prefetch thread, a started server. A DataLoader worker forked from
//! the main process inherits copies of them (the same sockets, the same pin pages
//! in shared memory, thread handles of threads it does not have); using one would
//! speak on the parent's connection, and dropping one would shut the parent's
//! sockets, release its leases or join a thread that is not there. So each is held
//! with the id of the process that made it: another process sees nothing, makes its
//! own, and leaves the inherited copy undropped (its descriptors close when that
//! process exits).

use std::mem::ManuallyDrop;

/// A value that belongs to the process that made it.
pub struct ProcessBound<T> {
    owner: u32,
    value: ManuallyDrop<T>,
}

impl<T> ProcessBound<T> {
    /// `value`, owned by this process.
    pub fn new(value: T) -> ProcessBound<T> {
        ProcessBound {
            owner: std::process::id(),
            value: ManuallyDrop::new(value),
        }
    }

    /// Whether this process made it.
    pub fn is_ours(&self) -> bool {
        self.owner == std::process::id()
    }

    /// The value, in the process that made it.
    pub fn get(&self) -> Option<&T> {
        match self.is_ours() {
            true => Some(&self.value),
            false => None,
        }
    }
}

impl<T> Drop for ProcessBound<T> {
    fn drop(&mut self) {
        if self.is_ours() {
            // SAFETY: dropped once, here, and never used again.
            unsafe { ManuallyDrop::drop(&mut self.value) };
        }
    }
}

/// The value of `slot` that this process made, made with `make` if there is none
/// (an inherited one is left undropped, see the module doc).
pub fn ours_or_make<T, E>(
    slot: &mut Option<ProcessBound<T>>,
    make: impl FnOnce() -> Result<T, E>,
) -> Result<&mut T, E> {
    let bound = match slot.take() {
        Some(bound) if bound.is_ours() => bound,
        // An inherited value is dropped here, which leaves the value itself alone.
        _ => ProcessBound::new(make()?),
    };
    Ok(&mut slot.insert(bound).value)
}
