//! The training loader's announcer of its read order (the planned policy): when
//! the loader starts an epoch (or resumes mid-epoch) it announces the records of the
//! rest of that epoch and of the whole next one, naming its worker connections as
//! the order's readers, and after every batch it writes how far the consumer has
//! got into its own pin page (no message). The server then evicts the record needed
//! last. With `DATA.CACHE_PREFETCH` the announcer also drives the loader's
//! [`prefetch`](super::prefetch) thread.
//!
//! Nothing here can fail a batch: a read order the server refuses, or a prefetch
//! that fails, is logged, and the cache goes on by LRU for what no read order names.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::cache::protocol::ClientId;
use crate::cache::{CacheClient, CacheError};

use super::prefetch::{Prefetcher, Progress};
use super::read_order::ReadOrderSource;
use super::source::CacheCounters;

/// One rank's announcer of its read order (and its prefetch thread).
pub struct ReadOrderAnnouncer {
    source: Arc<ReadOrderSource>,
    client: CacheClient,
    readers: Vec<ClientId>,
    /// The epoch whose read order was announced last.
    announced: Option<u64>,
    /// Set when the server refused a read order: no more are sent.
    given_up: bool,
    progress: Arc<Progress>,
    prefetch: Option<Prefetcher>,
}

impl ReadOrderAnnouncer {
    /// Connects the announcing connection (`name`/read-order) to the server at
    /// `address`; `readers` are the loader's worker connections. With `prefetch` (`Some(n)`), a
    /// thread fills records up to `n` steps ahead of the workers, counting them in
    /// `counters`.
    pub fn connect(
        address: &str,
        name: &str,
        source: ReadOrderSource,
        readers: Vec<ClientId>,
        prefetch: Option<u64>,
        counters: Arc<CacheCounters>,
    ) -> Result<ReadOrderAnnouncer, CacheError> {
        let client = CacheClient::connect(address, &format!("{name}/read-order"))?;
        let source = Arc::new(source);
        let progress = Arc::new(Progress {
            lookahead: prefetch.unwrap_or(0).max(1),
            ..Progress::default()
        });
        let prefetch = match prefetch.is_some() {
            true => Some(Prefetcher::start(
                address.to_string(),
                format!("{name}/prefetch"),
                Arc::clone(&source),
                Arc::clone(&progress),
                counters,
            )?),
            false => None,
        };
        Ok(ReadOrderAnnouncer {
            source,
            client,
            readers,
            announced: None,
            given_up: false,
            progress,
            prefetch,
        })
    }

    /// Called before the sample at `position` of `epoch` goes to the workers: the
    /// first time in an epoch, the read order from there on is announced.
    pub fn dispatching(&mut self, epoch: u64, position: usize) {
        if self.announced != Some(epoch) && !self.given_up {
            self.announce(epoch, position);
        }
    }

    /// The samples before `position` of `epoch` are with the workers.
    pub fn dispatched(&self, epoch: u64, position: usize) {
        let step = self.source.step(epoch, position);
        self.progress.dispatched.store(step, Ordering::Release);
    }

    fn announce(&mut self, epoch: u64, position: usize) {
        let order = self.source.order_from(epoch, position);
        let announcement = self.source.announcement(&order, &self.readers);
        self.client.set_read_progress(order.first_step);
        self.progress
            .consumed
            .store(order.first_step, Ordering::Release);
        match self.client.announce_read_order(announcement) {
            Ok(()) => {
                self.announced = Some(epoch);
                if let Some(prefetch) = &self.prefetch {
                    prefetch.follow(order);
                }
            }
            Err(error) => {
                tracing::warn!(%error, epoch, "the cache refused this rank's read order; it evicts by LRU");
                self.given_up = true;
            }
        }
    }

    /// The consumer has taken every sample before `position` of `epoch`.
    pub fn consumed(&self, epoch: u64, position: usize) {
        let step = self.source.step(epoch, position);
        self.client.set_read_progress(step);
        self.progress.consumed.store(step, Ordering::Release);
        if let Some(prefetch) = &self.prefetch {
            prefetch.wake();
        }
    }
}
