//! Reserving the memory under slots as they are carved: the store's memory follows
//! its data, up to the cap. A [`PageReserver`] backs a byte range with memory (the
//! server's is the memfd, see [`shm`](super::super::shm)); [`Reservations`] keeps
//! the count of bytes reserved and of reservations refused.

use std::fmt;

/// Why memory could not be reserved for a range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRefusal {
    /// Bytes asked for.
    pub needed: u64,
    /// Bytes the machine (or the limit) could give.
    pub available: u64,
    /// Which limit refused it (MemAvailable, the cgroup's memory.max, fallocate).
    pub limit: String,
}

impl fmt::Display for ReserveRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes needed, {} bytes available ({})",
            self.needed, self.available, self.limit
        )
    }
}

/// Backs byte ranges of the store with memory before they are handed out, so that
/// no process ever faults on a page the machine cannot give.
pub trait PageReserver: Send {
    /// Reserves `[offset, offset + len)`; on an error nothing is reserved.
    fn reserve(&mut self, offset: u64, len: u64) -> Result<(), ReserveRefusal>;
}

/// Reserves nothing: for stores whose table and arena live on the heap.
#[derive(Debug, Default)]
pub struct NoReserve;

impl PageReserver for NoReserve {
    fn reserve(&mut self, _offset: u64, _len: u64) -> Result<(), ReserveRefusal> {
        Ok(())
    }
}

/// Grants at most `budget` bytes in all, then refuses: a stand-in for a machine
/// that runs out of memory (tests, and a hard limit below the cap).
#[derive(Debug)]
pub struct BudgetReserver {
    /// Bytes still grantable.
    pub budget: u64,
}

impl PageReserver for BudgetReserver {
    fn reserve(&mut self, _offset: u64, len: u64) -> Result<(), ReserveRefusal> {
        if len > self.budget {
            return Err(ReserveRefusal {
                needed: len,
                available: self.budget,
                limit: "the reservation budget".into(),
            });
        }
        self.budget -= len;
        Ok(())
    }
}

/// A reserver and its counts.
pub struct Reservations {
    reserver: Box<dyn PageReserver>,
    reserved: u64,
    refused: u64,
}

impl fmt::Debug for Reservations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservations")
            .field("reserved", &self.reserved)
            .field("refused", &self.refused)
            .finish()
    }
}

impl Reservations {
    /// Counts over `reserver`, with `already` bytes reserved before (the metadata).
    pub fn new(reserver: Box<dyn PageReserver>, already: u64) -> Reservations {
        Reservations {
            reserver,
            reserved: already,
            refused: 0,
        }
    }

    /// Reserves a range, counting it, or counting the refusal.
    pub fn reserve(&mut self, offset: u64, len: u64) -> Result<(), ReserveRefusal> {
        match self.reserver.reserve(offset, len) {
            Ok(()) => {
                self.reserved += len;
                Ok(())
            }
            Err(refusal) => {
                self.refused += 1;
                Err(refusal)
            }
        }
    }

    /// Bytes reserved so far.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    /// Reservations refused so far.
    pub fn refusals(&self) -> u64 {
        self.refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_is_granted_and_what_is_refused() {
        let mut r = Reservations::new(Box::new(BudgetReserver { budget: 100 }), 7);
        r.reserve(0, 60).unwrap();
        let refusal = r.reserve(60, 50).unwrap_err();
        assert_eq!((refusal.needed, refusal.available), (50, 40), "{refusal}");
        r.reserve(60, 40).unwrap();
        assert_eq!((r.reserved_bytes(), r.refusals()), (107, 1));
        assert!(r.reserve(100, 1).is_err());
        assert_eq!((r.reserved_bytes(), r.refusals()), (107, 2));
    }
}
