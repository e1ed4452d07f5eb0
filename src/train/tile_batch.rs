//! How many validation tiles go through the model at once, as memory allows: one
//! on the CPU (nothing to gain); on a GPU one for the first clip, whose tiles the
//! CUDA allocator's peak measures, then as many as fit in `BUDGET` of the card
//! beside what was allocated before validation, at most [`MAX_TILE_BATCH`]. A clip
//! that still runs out of memory at more than one goes again one at a time, and the
//! rest of the run keeps to one.

use tch::Device;

/// Most tiles at once.
pub const MAX_TILE_BATCH: usize = 8;

/// The share of the card's memory tiles may fill.
const BUDGET: f64 = 0.8;

/// The tile batch of one validator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TileBatch {
    /// The CUDA device, `None` on the CPU.
    device: Option<usize>,
    /// Tiles at once, once chosen.
    chosen: Option<usize>,
    /// Bytes allocated when the measured clip started.
    base: u64,
}

impl TileBatch {
    /// One tile at a time until measured (always on the CPU).
    pub fn new(device: Device) -> TileBatch {
        let device = match device {
            Device::Cuda(i) => Some(i),
            _ => None,
        };
        TileBatch {
            chosen: if device.is_none() { Some(1) } else { None },
            device,
            base: 0,
        }
    }

    /// Tiles at once for the next clip; before the first choice it starts measuring
    /// one (the allocator's peak reset).
    pub fn before_clip(&mut self) -> usize {
        if let Some(n) = self.chosen {
            return n;
        }
        if let Some(device) = self.device {
            let stats = crate::ddp::cuda_memory_stats(device).ok().flatten();
            self.base = stats.map_or(0, |s| s.allocated_current);
            if crate::ddp::reset_cuda_peak(device).is_err() {
                self.chosen = Some(1);
            }
        }
        1
    }

    /// After a clip: the first measured one chooses the batch from its peak.
    pub fn after_clip(&mut self) {
        let (None, Some(device)) = (self.chosen, self.device) else {
            return;
        };
        let peak = crate::ddp::cuda_memory_stats(device)
            .ok()
            .flatten()
            .map(|s| s.allocated_peak);
        let total = crate::ddp::torch_runtime()
            .devices
            .ok()
            .and_then(|d| d.into_iter().find(|d| d.index == device))
            .map(|d| d.total_memory);
        let n = match (peak, total) {
            (Some(peak), Some(total)) => choose(peak.saturating_sub(self.base), self.base, total),
            _ => 1,
        };
        tracing::info!(
            tiles_at_once = n,
            "validation tiles batched as the first clip's memory allows"
        );
        self.chosen = Some(n);
    }

    /// One at a time from now on (after an out-of-memory at more).
    pub fn fall_back(&mut self) {
        self.chosen = Some(1);
    }
}

/// Tiles at once when one tile needs `per_tile` bytes beyond the `base` allocated
/// before, on a card of `total` bytes.
pub fn choose(per_tile: u64, base: u64, total: u64) -> usize {
    let room = (total as f64 * BUDGET - base as f64).max(0.0);
    let n = (room / per_tile.max(1) as f64).floor() as usize;
    n.clamp(1, MAX_TILE_BATCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn as_many_tiles_as_fit_the_budget() {
        // An 80 GiB card, 2 GiB of weights, 12 GiB a tile: (64 - 2) / 12 = 5.
        assert_eq!(choose(12 * GIB, 2 * GIB, 80 * GIB), 5);
        // The user's 48 GiB card: (38.4 - 2) / 12 = 3.
        assert_eq!(choose(12 * GIB, 2 * GIB, 48 * GIB), 3);
        assert_eq!(choose(40 * GIB, 2 * GIB, 48 * GIB), 1, "at least one");
        assert_eq!(
            choose(GIB / 10, 0, 80 * GIB),
            MAX_TILE_BATCH,
            "at most the cap"
        );
        assert_eq!(choose(0, 90 * GIB, 80 * GIB), 1, "no room: one");
    }

    #[test]
    fn the_cpu_takes_one_tile_at_a_time() {
        let mut batch = TileBatch::new(Device::Cpu);
        assert_eq!(batch.before_clip(), 1);
        batch.after_clip();
        assert_eq!(batch.before_clip(), 1);
    }
}
