//! The store's shared memory: one memfd segment, created and reserved up front by the
//! server (so a short machine fails at start with the sizes, never with a SIGBUS
//! mid-epoch), handed to clients over the control channel and mapped once per process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use ipc_channel::ipc::IpcSharedMemory;

use super::table::{Layout, Table};
use super::CacheError;
use crate::util::meminfo;

/// The server's segment: the memfd, zero-filled (every page allocated) at creation.
pub struct Segment {
    memory: IpcSharedMemory,
    base: *const u8,
}

// SAFETY: `base` points into the mapping `memory` owns, which lives as long as the
// segment; the server itself only touches the metadata region, through atomics.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates and reserves `len` bytes, after checking that the machine has them.
    pub fn create(len: u64) -> Result<Segment, CacheError> {
        let available = meminfo::shared_memory_available()?;
        if len > available.bytes {
            return Err(CacheError::ShmTooSmall {
                requested: len,
                available: available.bytes,
                limit: available.limit,
            });
        }
        let len = usize::try_from(len).map_err(|_| CacheError::ShmTooSmall {
            requested: len,
            available: available.bytes,
            limit: "address space".into(),
        })?;
        // Writing every byte allocates every page of the memfd now.
        let mut memory = IpcSharedMemory::from_byte(0, len);
        // SAFETY: the pointer is taken once; no `&mut [u8]` over the region is made
        // again, and the server reaches it only through the table's atomics.
        let base = unsafe { memory.deref_mut() }.as_ptr();
        Ok(Segment { memory, base })
    }

    /// Writes a fresh slot table into the segment's metadata region.
    pub fn create_table(self: &Arc<Self>, layout: Layout) -> Result<Table, CacheError> {
        if layout.total_bytes() > self.len() {
            return Err(CacheError::Protocol(format!(
                "segment of {} bytes cannot hold the layout {layout:?}",
                self.len()
            )));
        }
        // SAFETY: the metadata lies inside the segment (checked above), starts at a
        // page-aligned offset of a page-aligned mapping, is zeroed (from_byte(0)) and
        // touched only through atomics; the Arc keeps the mapping alive.
        Ok(unsafe {
            Table::create(
                self.base.add(layout.meta_offset() as usize),
                layout,
                Arc::clone(self) as Arc<dyn super::table::Backing>,
            )
        })
    }

    /// A handle to send to a client (a dup of the memfd).
    pub fn share(&self) -> IpcSharedMemory {
        self.memory.clone()
    }

    /// Bytes in the segment.
    pub fn len(&self) -> u64 {
        self.memory.len() as u64
    }

    /// Whether the segment is empty (never, for a valid store).
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }
}

/// A client process's mapping of a store, shared by all its connections.
pub struct Mapping {
    store_id: u64,
    base: *mut u8,
    len: usize,
    // Keeps the memfd and its mapping alive; `base` points into it.
    _memory: IpcSharedMemory,
}

// SAFETY: the mapping is a fixed MAP_SHARED region that lives as long as `_memory`;
// threads only touch the ranges of slots they hold a lease or a reserved fill on,
// which the server never hands to two writers or to a writer and a reader at once,
// and the metadata region only through atomics (see `table`).
unsafe impl Send for Mapping {}
// SAFETY: as above; shared references only hand out raw ranges under that protocol.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(store_id: u64, mut memory: IpcSharedMemory) -> Mapping {
        // SAFETY: we take the base pointer once and never create a `&mut [u8]` over the
        // whole region again; all later access is through disjoint slot ranges.
        let region = unsafe { memory.deref_mut() };
        Mapping {
            store_id,
            base: region.as_mut_ptr(),
            len: region.len(),
            _memory: memory,
        }
    }

    /// The store this maps.
    pub fn store_id(&self) -> u64 {
        self.store_id
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The store's slot table, whose metadata follows an arena of `arena_bytes`.
    pub fn table(self: &Arc<Self>, arena_bytes: u64) -> Result<Table, CacheError> {
        let meta_offset = super::table::meta_offset_after(arena_bytes);
        if meta_offset >= self.len as u64 {
            return Err(CacheError::Protocol(format!(
                "store of {} bytes has no metadata after an arena of {arena_bytes} bytes",
                self.len
            )));
        }
        // SAFETY: `meta_offset` is inside the mapping (checked above) and page-aligned
        // in a page-aligned mapping; the server created atomics there and every
        // process touches them only as atomics; the Arc keeps the mapping alive.
        // `attach` checks the header's sizes against the mapping's length.
        let table = unsafe {
            Table::attach(
                self.base.add(meta_offset as usize),
                meta_offset,
                self.len as u64,
                Arc::clone(self) as Arc<dyn super::table::Backing>,
            )
        }?;
        Ok(table)
    }

    /// The start of `[offset, offset + len)`, checked against the mapping's bounds.
    pub fn range(&self, offset: u64, len: u64) -> Result<*mut u8, CacheError> {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= self.len as u64 => {
                // SAFETY: offset + len is within the mapping, checked just above.
                Ok(unsafe { self.base.add(offset as usize) })
            }
            _ => Err(CacheError::BadGrant {
                offset,
                len,
                store_len: self.len as u64,
            }),
        }
    }
}

type Registry = Mutex<HashMap<String, Weak<Mapping>>>;

fn registry() -> &'static Registry {
    static MAPPINGS: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    MAPPINGS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The registry, locked; an error if a panic elsewhere in this process poisoned it.
fn locked_registry(
) -> Result<std::sync::MutexGuard<'static, HashMap<String, Weak<Mapping>>>, CacheError> {
    registry().lock().map_err(|_| CacheError::Poisoned)
}

/// The id of the store this process maps for `address`, if it maps one.
pub fn mapped_store(address: &str) -> Result<Option<u64>, CacheError> {
    let map = locked_registry()?;
    Ok(map.get(address).and_then(Weak::upgrade).map(|m| m.store_id))
}

/// This process's mapping for `address`: the existing one if it is of `store_id`,
/// else a new one from `memory`.
pub fn adopt(
    address: &str,
    store_id: u64,
    memory: Option<IpcSharedMemory>,
) -> Result<Arc<Mapping>, CacheError> {
    let mut map = locked_registry()?;
    if let Some(existing) = map.get(address).and_then(Weak::upgrade) {
        if existing.store_id == store_id {
            return Ok(existing);
        }
    }
    let memory = memory.ok_or_else(|| {
        CacheError::Protocol("the server sent no store to a process that maps none".into())
    })?;
    let mapping = Arc::new(Mapping::new(store_id, memory));
    map.insert(address.to_string(), Arc::downgrade(&mapping));
    Ok(mapping)
}
