//! DDP semantics over a [`ProcessGroup`]: parameter shapes verified and values
//! broadcast from rank 0 at start, gradients averaged in flat buckets (first
//! ~1 MB, then ~25 MB) once per optimizer step, and a parameter-hash check.
//!
//! Gradients are synchronised after backward, not overlapped with it
//! (`DIST.GRAD_SYNC: after_backward`): the baseline of the slow-link benchmark and a
//! path with no autograd hooks at all. Training overlaps the all-reduces with
//! backward through PyTorch DDP's Reducer by default ([`super::reducer`]).

use tch::{Device, Kind, Tensor};

use super::error::DistError;
use super::group::{ensure_grad, ProcessGroup, ReduceOp};
use crate::util::readback;

/// Default size of the first gradient bucket (the last layers' gradients,
/// ready first), as in PyTorch's DDP.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;
/// Default size of the following buckets, as in PyTorch's DDP (`bucket_cap_mb`).
pub const BUCKET_BYTES: usize = 25 << 20;

/// Bucket sizes for [`Ddp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DdpOptions {
    /// Cap of the first bucket, in bytes.
    pub first_bucket_bytes: usize,
    /// Cap of every later bucket, in bytes.
    pub bucket_bytes: usize,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            first_bucket_bytes: FIRST_BUCKET_BYTES,
            bucket_bytes: BUCKET_BYTES,
        }
    }
}

/// One flat buffer holding a run of same-dtype, same-device parameters.
struct Bucket {
    /// Indices into `Ddp::params`, in bucket order.
    members: Vec<usize>,
    /// Element offset and count of each member in `buffer`.
    spans: Vec<(i64, i64)>,
    /// The flat buffer all-reduced or broadcast in one collective.
    buffer: Tensor,
}

impl Bucket {
    /// Copies `tensors` (one per member, in bucket order) into the flat buffer.
    fn pack(&self, tensors: &[Tensor], rank: usize, op: &'static str) -> Result<(), DistError> {
        for (tensor, &(offset, numel)) in tensors.iter().zip(&self.spans) {
            let flat = tensor.f_reshape([-1]).map_err(tensor_err(rank, op))?;
            copy_into(&self.buffer.narrow(0, offset, numel), &flat, rank, op)?;
        }
        Ok(())
    }

    /// Copies the flat buffer back into `tensors` (one per member, in bucket order).
    fn unpack(&self, tensors: &[Tensor], rank: usize, op: &'static str) -> Result<(), DistError> {
        for (tensor, &(offset, numel)) in tensors.iter().zip(&self.spans) {
            let slice = self
                .buffer
                .narrow(0, offset, numel)
                .f_view_as(tensor)
                .map_err(tensor_err(rank, op))?;
            copy_into(tensor, &slice, rank, op)?;
        }
        Ok(())
    }
}

/// Data-parallel training state of one rank: its parameters and the bucket
/// layout (identical on every rank, since shapes were checked to match).
pub struct Ddp {
    params: Vec<Tensor>,
    buckets: Vec<Bucket>,
    rank: usize,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp")
            .field("params", &self.params.len())
            .field("bucket_sizes", &self.bucket_sizes())
            .field("rank", &self.rank)
            .finish()
    }
}

/// Groups parameters into buckets. `params` holds (bytes, dtype/device key) in
/// registration order; buckets are filled from the last parameter backwards
/// (the order backward produces gradients), one open bucket per key, and a
/// bucket closes once it reaches its cap (the first closed one `first_cap`,
/// later ones `cap`). Returns each bucket's parameter indices.
pub fn bucket_groups<K: PartialEq + Clone>(
    params: &[(usize, K)],
    first_cap: usize,
    cap: usize,
) -> Vec<Vec<usize>> {
    let mut closed: Vec<Vec<usize>> = Vec::new();
    let mut open: Vec<(K, Vec<usize>, usize)> = Vec::new();
    for index in (0..params.len()).rev() {
        let (bytes, key) = &params[index];
        let slot = match open.iter().position(|(k, _, _)| k == key) {
            Some(slot) => slot,
            None => {
                open.push((key.clone(), Vec::new(), 0));
                open.len() - 1
            }
        };
        open[slot].1.push(index);
        open[slot].2 += bytes;
        let limit = if closed.is_empty() { first_cap } else { cap };
        if open[slot].2 >= limit {
            let (_, members, _) = open.remove(slot);
            closed.push(members);
        }
    }
    closed.extend(
        open.into_iter()
            .map(|(_, members, _)| members)
            .filter(|m| !m.is_empty()),
    );
    closed
}

impl Ddp {
    /// Wraps this rank's parameters (e.g. `VarStore::trainable_variables()`):
    /// checks that every rank has the same parameter dtypes and shapes, then
    /// overwrites them with rank 0's values. Every rank must call this.
    pub fn new(
        group: &mut ProcessGroup,
        params: Vec<Tensor>,
        options: DdpOptions,
    ) -> Result<Self, DistError> {
        let rank = group.rank();
        verify_shapes(group, &params)?;
        let keys: Vec<(usize, (Kind, Device))> = params
            .iter()
            .map(|p| (tensor_bytes(p), (p.kind(), p.device())))
            .collect();
        let groups = bucket_groups(&keys, options.first_bucket_bytes, options.bucket_bytes);
        let mut buckets = Vec::with_capacity(groups.len());
        for members in groups {
            let mut spans = Vec::with_capacity(members.len());
            let mut offset = 0i64;
            for &index in &members {
                let numel = params[index].numel() as i64;
                spans.push((offset, numel));
                offset += numel;
            }
            let (kind, device) = keys[members[0]].1;
            let buffer =
                Tensor::f_zeros([offset], (kind, device)).map_err(|e| DistError::Tensor {
                    rank,
                    op: "ddp init",
                    message: format!("cannot allocate a bucket of {offset} elements: {e}"),
                })?;
            buckets.push(Bucket {
                members,
                spans,
                buffer,
            });
        }
        let mut ddp = Ddp {
            params,
            buckets,
            rank,
        };
        ddp.broadcast_parameters(group, 0)?;
        tracing::debug!(rank, buckets = ?ddp.bucket_sizes(), "ddp ready");
        Ok(ddp)
    }

    /// The wrapped parameters (shallow handles on the model's tensors).
    pub fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    /// Bytes of each gradient bucket, in communication order.
    pub fn bucket_sizes(&self) -> Vec<usize> {
        self.buckets
            .iter()
            .map(|b| tensor_bytes(&b.buffer))
            .collect()
    }

    /// Overwrites every rank's parameters with `root`'s, bucket by bucket.
    pub fn broadcast_parameters(
        &mut self,
        group: &mut ProcessGroup,
        root: usize,
    ) -> Result<(), DistError> {
        let rank = self.rank;
        for bucket in &mut self.buckets {
            let params: Vec<Tensor> = bucket
                .members
                .iter()
                .map(|&index| self.params[index].shallow_clone())
                .collect();
            tch::no_grad(|| -> Result<(), DistError> {
                bucket.pack(&params, rank, "broadcast")?;
                group.broadcast(&mut bucket.buffer, root)?;
                bucket.unpack(&params, rank, "broadcast")
            })?;
        }
        Ok(())
    }

    /// Averages the accumulated gradients over ranks: one all-reduce a bucket.
    /// Call once per optimizer step, after the last micro-batch's backward and
    /// before `optimizer.step()`. A parameter without a gradient on this rank
    /// gets a zero one, so the buckets line up across ranks.
    pub fn sync_gradients(&mut self, group: &mut ProcessGroup) -> Result<(), DistError> {
        let rank = self.rank;
        if group.world_size() == 1 {
            return Ok(());
        }
        tch::no_grad(|| -> Result<(), DistError> {
            for bucket in &mut self.buckets {
                let mut grads = Vec::with_capacity(bucket.members.len());
                for &index in &bucket.members {
                    ensure_grad(&mut self.params[index]).map_err(|message| DistError::Tensor {
                        rank,
                        op: "sync_gradients",
                        message,
                    })?;
                    grads.push(
                        self.params[index]
                            .f_grad()
                            .map_err(tensor_err(rank, "sync_gradients"))?,
                    );
                }
                bucket.pack(&grads, rank, "sync_gradients")?;
                group.all_reduce(&mut bucket.buffer, ReduceOp::Avg)?;
                bucket.unpack(&grads, rank, "sync_gradients")?;
            }
            Ok(())
        })
    }

    /// A 64-bit hash of this rank's parameter values (bit-exact) and shapes.
    pub fn parameter_hash(&self) -> Result<u64, DistError> {
        parameter_hash(&self.params, self.rank)
    }

    /// Compares every rank's [`Ddp::parameter_hash`] (for `TRAIN.PARAM_CHECK_EVERY`);
    /// fails on every rank, naming the ranks that differ from rank 0, if any.
    pub fn check_parameters(&self, group: &mut ProcessGroup, step: u64) -> Result<(), DistError> {
        check_parameters(group, &self.params, step)
    }
}

/// A 64-bit hash of `params`' values (bit-exact) and shapes on this rank.
pub fn parameter_hash(params: &[Tensor], rank: usize) -> Result<u64, DistError> {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for param in params {
        let bytes = tensor_bytes_on_host(param).map_err(tensor_err(rank, "parameter_hash"))?;
        let mut crc = crc32fast::Hasher::new();
        for dim in param.size() {
            crc.update(&dim.to_le_bytes());
        }
        crc.update(&bytes);
        hash = (hash ^ u64::from(crc.finalize())).wrapping_mul(0x0000_0100_0000_01b3);
        hash = hash.rotate_left(17);
    }
    Ok(hash)
}

/// Compares every rank's [`parameter_hash`] of `params`; fails on every rank,
/// naming the ranks that differ from rank 0, if any.
pub fn check_parameters(
    group: &mut ProcessGroup,
    params: &[Tensor],
    step: u64,
) -> Result<(), DistError> {
    let rank = group.rank();
    let mine = parameter_hash(params, rank)?;
    let all = exchange_i64(group, mine as i64)?;
    let differing: Vec<usize> = (1..all.len()).filter(|&r| all[r] != all[0]).collect();
    if differing.is_empty() {
        return Ok(());
    }
    let listing: Vec<String> = all
        .iter()
        .enumerate()
        .map(|(r, h)| format!("rank {r} {:016x}", *h as u64))
        .collect();
    Err(DistError::Diverged {
        rank,
        step,
        message: format!(
            "rank(s) {differing:?} hold different parameters from rank 0 (hashes: {})",
            listing.join(", ")
        ),
    })
}

/// Every rank's `value`, indexed by rank (a one-hot all-reduce; exact for i64).
fn exchange_i64(group: &mut ProcessGroup, value: i64) -> Result<Vec<i64>, DistError> {
    let mut slots = vec![0i64; group.world_size()];
    slots[group.rank()] = value;
    let tensor = group.all_reduce_host(&Tensor::from_slice(&slots), ReduceOp::Sum)?;
    readback::values::<i64>(&tensor).map_err(|e| DistError::Tensor {
        rank: group.rank(),
        op: "exchange",
        message: e.to_string(),
    })
}

/// Fails on every rank unless all ranks hold the same parameter list
/// (count, then each parameter's dtype and shape).
pub(crate) fn verify_shapes(group: &mut ProcessGroup, params: &[Tensor]) -> Result<(), DistError> {
    let rank = group.rank();
    let counts = exchange_i64(group, params.len() as i64)?;
    if counts.iter().any(|&c| c != counts[0]) {
        let listing: Vec<String> = counts
            .iter()
            .enumerate()
            .map(|(r, c)| format!("rank {r}: {c}"))
            .collect();
        return Err(DistError::ShapeMismatch {
            rank,
            message: format!("parameter counts differ ({})", listing.join(", ")),
        });
    }
    let signatures: Vec<i64> = params.iter().map(shape_signature).collect();
    if signatures.is_empty() {
        return Ok(());
    }
    let low = group.all_reduce_host(&Tensor::from_slice(&signatures), ReduceOp::Min)?;
    let high = group.all_reduce_host(&Tensor::from_slice(&signatures), ReduceOp::Max)?;
    let differs = low.ne_tensor(&high).nonzero().reshape([-1]);
    let differs = readback::values::<i64>(&differs).map_err(|e| DistError::Tensor {
        rank,
        op: "verify_shapes",
        message: e.to_string(),
    })?;
    if differs.is_empty() {
        return Ok(());
    }
    let described: Vec<String> = differs
        .iter()
        .take(5)
        .map(|&i| {
            let p = &params[i as usize];
            format!(
                "parameter #{i} ({:?} {:?} on this rank)",
                p.kind(),
                p.size()
            )
        })
        .collect();
    Err(DistError::ShapeMismatch {
        rank,
        message: format!(
            "{} of {} parameters differ in dtype or shape: {}",
            differs.len(),
            params.len(),
            described.join(", ")
        ),
    })
}

/// A hash of a parameter's dtype and shape.
fn shape_signature(param: &Tensor) -> i64 {
    let mut crc = crc32fast::Hasher::new();
    crc.update(format!("{:?}", param.kind()).as_bytes());
    for dim in param.size() {
        crc.update(&dim.to_le_bytes());
    }
    i64::from(crc.finalize())
}

fn tensor_bytes(tensor: &Tensor) -> usize {
    tensor.numel() * tensor.kind().elt_size_in_bytes()
}

/// The raw bytes of `tensor`, copied to host memory.
fn tensor_bytes_on_host(tensor: &Tensor) -> Result<Vec<u8>, tch::TchError> {
    let flat = tensor
        .f_detach()?
        .f_to_device(Device::Cpu)?
        .f_contiguous()?
        .f_reshape([-1])?;
    let bytes = flat.f_view_dtype(Kind::Uint8)?;
    readback::values::<u8>(&bytes)
}

fn copy_into(dst: &Tensor, src: &Tensor, rank: usize, op: &'static str) -> Result<(), DistError> {
    let mut dst = dst.shallow_clone();
    dst.f_copy_(src).map_err(tensor_err(rank, op))
}

fn tensor_err(rank: usize, op: &'static str) -> impl Fn(tch::TchError) -> DistError {
    move |e| DistError::Tensor {
        rank,
        op,
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_backwards_first_small_then_large() {
        const MB: usize = 1 << 20;
        // Seven f32 params of 0.4 MB and one of 30 MB, registration order.
        let mut params: Vec<(usize, u8)> = vec![(400 * 1024, 0); 7];
        params.insert(2, (30 * MB, 0));
        let groups = bucket_groups(&params, MB, 25 * MB);
        // Backwards: 7,6,5 reach 1.2 MB >= 1 MB; 4,3,2(30 MB) reach the 25 MB cap;
        // 1,0 are the tail.
        assert_eq!(groups, vec![vec![7, 6, 5], vec![4, 3, 2], vec![1, 0]]);
        let every: usize = groups.iter().map(Vec::len).sum();
        assert_eq!(every, params.len());
    }

    #[test]
    fn buckets_never_mix_dtypes() {
        let params = vec![(10, "f32"), (10, "f16"), (10, "f32"), (10, "f16")];
        let groups = bucket_groups(&params, 1000, 1000);
        assert_eq!(groups, vec![vec![3, 1], vec![2, 0]]);
        assert!(bucket_groups::<u8>(&[], 1, 1).is_empty());
    }

    #[test]
    fn parameter_hash_sees_one_ulp() {
        let mut group = super::super::group::gloo_world_of_one();
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let ddp =
            Ddp::new(&mut group, vec![a.shallow_clone()], DdpOptions::default()).expect("ddp");
        let before = ddp.parameter_hash().expect("hash");
        assert_eq!(before, ddp.parameter_hash().expect("hash"));
        tch::no_grad(|| {
            let mut handle = a.shallow_clone();
            let _ = handle.f_copy_(&Tensor::from_slice(&[
                1.0f32,
                2.0,
                f32::from_bits(3.0f32.to_bits() + 1),
            ]));
        });
        assert_ne!(before, ddp.parameter_hash().expect("hash"));
        ddp.check_parameters(&mut group, 1)
            .expect("one rank always agrees");
    }
}
