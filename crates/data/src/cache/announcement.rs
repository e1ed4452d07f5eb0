//! A read order as it travels from a reader to the server: the announcement, the
//! limits a server holds read orders to, what each part costs it in bytes, and the
//! announcement's decoding, which refuses one beyond those limits (or beyond the
//! bytes a receiving thread allows: the server's read-order budget) while it is
//! decoded, before it is built in memory: a frame of a few bytes cannot make the
//! server allocate gigabytes.
//!
//! A refusal while decoding fails the whole message; the receiving thread finds
//! why in [`take_refusal`] and answers it like any refused request, so the
//! connection stays up.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use super::ids::ClientId;
use super::table::MAX_KEY_BYTES;

/// Most uses one read order may announce (two epochs of a million clips of 6 frames
/// fit).
pub const MAX_ORDER_USES: usize = 1 << 24;
/// Most steps one read order may announce.
pub const MAX_ORDER_STEPS: usize = 1 << 24;
/// Most records one read order may name.
pub const MAX_ORDER_KEYS: usize = 1 << 22;
/// Most reader connections one read order may name.
pub const MAX_ORDER_READERS: usize = 1024;

/// Bytes a use takes in the server (its record, its step, the record's
/// following use).
pub const BYTES_PER_USE: u64 = 12;
/// Bytes a record a read order names takes in it (its id, first and next use,
/// and its entry in the record's list of read orders).
pub const BYTES_PER_ORDER_KEY: u64 = 20;
/// Bytes a record named by any read order takes once, beside its name.
pub const BYTES_PER_KEY: u64 = 72;
/// Bytes a read order takes beside its uses and records.
pub const BYTES_PER_ORDER: u64 = 256;
/// Bytes a step takes while an announcement is decoded.
const BYTES_PER_DECODED_STEP: u64 = 24;

/// A reader's announced reads: `steps[i]` are the indices in `keys` of the records
/// it reads at step `first_step + i`. Steps count the reader's samples (epoch after
/// epoch); the server compares uses of read orders by the time they are expected
/// (each job's steps at its own measured rate).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReadOrderAnnouncement {
    /// The step of `steps[0]`.
    pub first_step: u64,
    /// The records named, each once.
    pub keys: Vec<String>,
    /// Per step, indices into `keys`.
    pub steps: Vec<Vec<u32>>,
    /// The connections whose reads are this read order's (the reader's loader threads):
    /// a read by one of them uses up the record's next announced use.
    pub readers: Vec<ClientId>,
}

impl ReadOrderAnnouncement {
    /// Refuses one beyond the limits, naming a record twice, or naming keys it does
    /// not list (what decoding does not check already).
    pub fn check(&self) -> Result<(), String> {
        check_counts(self.keys.len(), self.steps.len(), self.readers.len())?;
        if let Some(key) = self.keys.iter().find(|k| k.len() > MAX_KEY_BYTES) {
            return Err(key_too_long(key));
        }
        let mut seen = HashSet::with_capacity(self.keys.len());
        if let Some(key) = self.keys.iter().find(|k| !seen.insert(k.as_str())) {
            return Err(format!("key {key:?} is listed twice"));
        }
        let uses: usize = self.steps.iter().map(Vec::len).sum();
        if uses > MAX_ORDER_USES {
            return Err(format!("{uses} uses, at most {MAX_ORDER_USES}"));
        }
        let keys = self.keys.len();
        for (i, step) in self.steps.iter().enumerate() {
            if let Some(&k) = step.iter().find(|&&k| k as usize >= keys) {
                return Err(format!(
                    "step {} names key {k} of a list of {keys}",
                    self.first_step.saturating_add(i as u64)
                ));
            }
        }
        Ok(())
    }

    /// The bytes the server takes for it at most (every record new to it).
    #[cfg(test)]
    fn bytes_at_most(&self) -> u64 {
        let uses: u64 = self.steps.iter().map(|s| s.len() as u64).sum();
        let names: u64 = self.keys.iter().map(|k| k.len() as u64).sum();
        BYTES_PER_ORDER
            + uses * BYTES_PER_USE
            + self.keys.len() as u64 * (BYTES_PER_ORDER_KEY + BYTES_PER_KEY)
            + names
            + 8 * self.readers.len() as u64
    }
}

fn check_counts(keys: usize, steps: usize, readers: usize) -> Result<(), String> {
    if keys > MAX_ORDER_KEYS {
        return Err(format!("{keys} keys, at most {MAX_ORDER_KEYS}"));
    }
    if steps > MAX_ORDER_STEPS {
        return Err(format!("{steps} steps, at most {MAX_ORDER_STEPS}"));
    }
    if readers > MAX_ORDER_READERS {
        return Err(format!("{readers} readers, at most {MAX_ORDER_READERS}"));
    }
    Ok(())
}

fn key_too_long(key: &str) -> String {
    let shown: String = key.chars().take(40).collect();
    format!(
        "key {shown:?}... is {} bytes long; keys are at most {MAX_KEY_BYTES} bytes",
        key.len()
    )
}

thread_local! {
    /// The bytes an announcement decoded on this thread may take.
    static DECODE_LIMIT: Cell<u64> = const { Cell::new(u64::MAX) };
    /// Why the last announcement decoded on this thread was refused.
    static REFUSAL: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Runs `receive` (which decodes a message) with announcements decoded only while
/// they take at most `bytes` (the server's read-order budget) and within the
/// limits.
pub fn decoding_at_most<R>(bytes: u64, receive: impl FnOnce() -> R) -> R {
    DECODE_LIMIT.with(|limit| limit.set(bytes));
    REFUSAL.with(|r| r.borrow_mut().take());
    let result = receive();
    DECODE_LIMIT.with(|limit| limit.set(u64::MAX));
    result
}

/// Why the last message decoded on this thread failed, if an announcement in it
/// was refused while decoding.
pub fn take_refusal() -> Option<String> {
    REFUSAL.with(|r| r.borrow_mut().take())
}

/// What decoding an announcement has taken so far.
struct Tally {
    left: u64,
    uses: usize,
}

impl Tally {
    fn take<E: de::Error>(&mut self, bytes: u64) -> Result<(), E> {
        match self.left.checked_sub(bytes) {
            Some(left) => {
                self.left = left;
                Ok(())
            }
            None => refuse(format!(
                "it takes more than the {:.1} MiB the server's read orders may hold (cache serve --read-order-budget)",
                DECODE_LIMIT.with(Cell::get) as f64 / f64::from(1u32 << 20)
            )),
        }
    }
}

fn refuse<T, E: de::Error>(why: String) -> Result<T, E> {
    let error = E::custom(format!("read order refused: {why}"));
    REFUSAL.with(|r| *r.borrow_mut() = Some(why));
    Err(error)
}

impl<'de> Deserialize<'de> for ReadOrderAnnouncement {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const FIELDS: &[&str] = &["first_step", "keys", "steps", "readers"];
        deserializer.deserialize_struct("ReadOrderAnnouncement", FIELDS, AnnouncementVisitor)
    }
}

struct AnnouncementVisitor;

impl<'de> Visitor<'de> for AnnouncementVisitor {
    type Value = ReadOrderAnnouncement;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a read order announcement")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut tally = Tally {
            left: DECODE_LIMIT.with(Cell::get),
            uses: 0,
        };
        tally.take(BYTES_PER_ORDER)?;
        let missing = |i| de::Error::invalid_length(i, &"4 fields");
        let first_step = seq.next_element::<u64>()?.ok_or_else(|| missing(0))?;
        let keys = seq
            .next_element_seed(Keys(&mut tally))?
            .ok_or_else(|| missing(1))?;
        let steps = seq
            .next_element_seed(Steps(&mut tally))?
            .ok_or_else(|| missing(2))?;
        let readers = seq
            .next_element_seed(Readers(&mut tally))?
            .ok_or_else(|| missing(3))?;
        Ok(ReadOrderAnnouncement {
            first_step,
            keys,
            steps,
            readers,
        })
    }
}

/// How many elements a sequence says it holds, refused beyond `max`.
fn announced_len<E: de::Error>(hint: Option<usize>, what: &str, max: usize) -> Result<usize, E> {
    let n = hint.unwrap_or(0);
    if n > max {
        return refuse(format!("{n} {what}, at most {max}"));
    }
    Ok(n)
}

struct Keys<'a>(&'a mut Tally);

impl<'de> DeserializeSeed<'de> for Keys<'_> {
    type Value = Vec<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Keys<'_> {
    type Value = Vec<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("the records' keys")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let n = announced_len(seq.size_hint(), "keys", MAX_ORDER_KEYS)?;
        self.0
            .take(n as u64 * (BYTES_PER_KEY + BYTES_PER_ORDER_KEY))?;
        let mut keys = Vec::with_capacity(n);
        while let Some(key) = seq.next_element_seed(Key(&mut *self.0))? {
            if keys.len() == MAX_ORDER_KEYS {
                return refuse(format!("more than {MAX_ORDER_KEYS} keys"));
            }
            keys.push(key);
        }
        Ok(keys)
    }
}

struct Key<'a>(&'a mut Tally);

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = String;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for Key<'_> {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a record's key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<String, E> {
        if key.len() > MAX_KEY_BYTES {
            return refuse(key_too_long(key));
        }
        self.0.take(key.len() as u64)?;
        Ok(key.to_string())
    }
}

struct Steps<'a>(&'a mut Tally);

impl<'de> DeserializeSeed<'de> for Steps<'_> {
    type Value = Vec<Vec<u32>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Steps<'_> {
    type Value = Vec<Vec<u32>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("the steps")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let n = announced_len(seq.size_hint(), "steps", MAX_ORDER_STEPS)?;
        self.0.take(n as u64 * BYTES_PER_DECODED_STEP)?;
        let mut steps = Vec::with_capacity(n);
        while let Some(step) = seq.next_element_seed(Step(&mut *self.0))? {
            if steps.len() == MAX_ORDER_STEPS {
                return refuse(format!("more than {MAX_ORDER_STEPS} steps"));
            }
            steps.push(step);
        }
        Ok(steps)
    }
}

struct Step<'a>(&'a mut Tally);

impl<'de> DeserializeSeed<'de> for Step<'_> {
    type Value = Vec<u32>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Step<'_> {
    type Value = Vec<u32>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a step's records")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let left = MAX_ORDER_USES - self.0.uses;
        let n = announced_len(seq.size_hint(), "uses", left)?;
        self.0.take(n as u64 * BYTES_PER_USE)?;
        let mut uses = Vec::with_capacity(n);
        while let Some(k) = seq.next_element::<u32>()? {
            if self.0.uses == MAX_ORDER_USES {
                return refuse(format!("more than {MAX_ORDER_USES} uses"));
            }
            self.0.uses += 1;
            uses.push(k);
        }
        Ok(uses)
    }
}

struct Readers<'a>(&'a mut Tally);

impl<'de> DeserializeSeed<'de> for Readers<'_> {
    type Value = Vec<ClientId>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Readers<'_> {
    type Value = Vec<ClientId>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("the reader connections")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let n = announced_len(seq.size_hint(), "readers", MAX_ORDER_READERS)?;
        self.0.take(8 * n as u64)?;
        let mut readers = Vec::with_capacity(n);
        while let Some(r) = seq.next_element::<ClientId>()? {
            if readers.len() == MAX_ORDER_READERS {
                return refuse(format!("more than {MAX_ORDER_READERS} readers"));
            }
            readers.push(r);
        }
        Ok(readers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(keys: usize, steps: usize, per_step: usize) -> ReadOrderAnnouncement {
        ReadOrderAnnouncement {
            first_step: 7,
            keys: (0..keys).map(|i| format!("seq/{i:06}")).collect(),
            steps: (0..steps)
                .map(|s| (0..per_step).map(|u| ((s + u) % keys) as u32).collect())
                .collect(),
            readers: vec![3, 4],
        }
    }

    #[test]
    fn a_read_order_round_trips_within_the_limits() {
        let o = order(100, 300, 6);
        let bytes = postcard::to_allocvec(&o).unwrap();
        let back: ReadOrderAnnouncement = decoding_at_most(o.bytes_at_most() * 2, || {
            postcard::from_bytes(&bytes).unwrap()
        });
        assert_eq!(back, o);
        assert_eq!(take_refusal(), None);
        assert_eq!(o.check(), Ok(()));
    }

    #[test]
    fn a_read_order_past_the_decoding_budget_is_refused_while_decoding() {
        let o = order(1000, 3000, 6);
        let bytes = postcard::to_allocvec(&o).unwrap();
        let result: Result<ReadOrderAnnouncement, _> =
            decoding_at_most(o.bytes_at_most() / 2, || postcard::from_bytes(&bytes));
        assert!(result.is_err());
        let why = take_refusal().unwrap();
        assert!(why.contains("--read-order-budget"), "{why}");
        assert_eq!(take_refusal(), None, "taken once");
    }

    /// postcard's varint of `n`.
    fn varint(mut n: u64, out: &mut Vec<u8>) {
        while n >= 0x80 {
            out.push((n as u8) | 0x80);
            n >>= 7;
        }
        out.push(n as u8);
    }

    #[test]
    fn counts_past_the_limits_are_refused_before_anything_is_built() {
        // first_step 0, one key "a", then MAX_ORDER_STEPS + 1 empty steps: the
        // count is refused before the steps are decoded.
        let mut frame = vec![0u8, 1, 1, b'a'];
        varint(MAX_ORDER_STEPS as u64 + 1, &mut frame);
        frame.resize(frame.len() + MAX_ORDER_STEPS + 1, 0);
        frame.push(0);
        let result: Result<ReadOrderAnnouncement, _> =
            decoding_at_most(u64::MAX, || postcard::from_bytes(&frame));
        assert!(result.is_err());
        let why = take_refusal().unwrap();
        assert!(why.contains("steps, at most"), "{why}");
        // A count larger than the frame could hold fails too (postcard does not
        // believe it), with no allocation of that size.
        let mut tiny = vec![0u8];
        varint(1 << 40, &mut tiny);
        let result: Result<ReadOrderAnnouncement, _> =
            decoding_at_most(u64::MAX, || postcard::from_bytes(&tiny));
        assert!(result.is_err());
    }

    #[test]
    fn a_long_key_is_refused_before_it_is_copied() {
        let mut o = order(2, 2, 1);
        o.keys[1] = "k".repeat(MAX_KEY_BYTES + 1);
        let bytes = postcard::to_allocvec(&o).unwrap();
        let result: Result<ReadOrderAnnouncement, _> =
            decoding_at_most(u64::MAX, || postcard::from_bytes(&bytes));
        assert!(result.is_err());
        assert!(take_refusal().unwrap().contains("keys are at most"));
        assert!(o.check().unwrap_err().contains("keys are at most"));
    }
}
