//! The store's shared memory: one sealed memfd, sized to the cap at start without
//! touching a page, whose pages are reserved (`fallocate`) only as records are
//! carved, after checking that the machine has them. Its size is sealed before any
//! client gets the fd, so no process can shrink it under the others; the server
//! passes the fd over the rendezvous socket ([`fdpass`](super::fdpass)).
//!
//! The server maps the whole memfd read-write. A client process maps it once,
//! read-only ([`Mapping`]), shared by all its connections: records, descriptors,
//! index and the other connections' pins. Writable are only what a connection owns:
//! its own page of pins ([`OwnPage`], one mapping per connection) and, while it
//! fills one, the extent of the record it fills ([`FillMap`], mapped at reserve and
//! unmapped before the commit). A stray write of a faulty client elsewhere in the
//! store faults in that client instead of corrupting what others read.

use std::collections::HashMap;
use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use nix::fcntl::{fallocate, fcntl, FallocateFlags, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use nix::sys::stat::fstat;
use nix::unistd::ftruncate;
use tracing::warn;

use super::pins::{PinPage, PinPages, PAGE_WORDS};
use super::store::reserve::{PageReserver, ReserveRefusal};
use super::table::{Layout, Table, TableWriter, PAGE};
use super::CacheError;
use crate::util::meminfo::{self, Available};

/// The seals every store carries: its size is fixed for good.
const SIZE_SEALS: SealFlag = SealFlag::F_SEAL_SHRINK.union(SealFlag::F_SEAL_GROW);

fn os_error(op: &'static str, errno: nix::errno::Errno) -> CacheError {
    CacheError::Shm {
        op,
        source: std::io::Error::from(errno),
    }
}

/// How a range of the memfd is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Read-only.
    Read,
    /// Read-write.
    Write,
    /// Read-write, the pages faulted in at once (a record about to be written whole).
    WritePopulated,
}

/// A `MAP_SHARED` mapping of a range of a memfd, unmapped on drop.
struct Region {
    base: NonNull<c_void>,
    len: usize,
}

impl Region {
    /// Maps `len` bytes of `fd` from `offset` (page-aligned).
    fn map(
        fd: BorrowedFd<'_>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<Region, CacheError> {
        let size = usize::try_from(len)
            .ok()
            .and_then(NonZeroUsize::new)
            .ok_or_else(|| CacheError::Protocol(format!("cannot map {len} bytes of the store")))?;
        let at = i64::try_from(offset)
            .ok()
            .filter(|_| offset % PAGE == 0)
            .ok_or_else(|| CacheError::Protocol(format!("cannot map the store at {offset}")))?;
        let (prot, flags) = match access {
            Access::Read => (ProtFlags::PROT_READ, MapFlags::MAP_SHARED),
            Access::Write => (
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
            ),
            Access::WritePopulated => (
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED | MapFlags::MAP_POPULATE,
            ),
        };
        // SAFETY: a fresh mapping at an address the kernel picks, of a memfd whose
        // size is sealed at `offset + len` or more (checked by the callers); nothing
        // else aliases it in this process until we hand out its pointer.
        let base =
            unsafe { mmap(None, size, prot, flags, fd, at) }.map_err(|e| os_error("mmap", e))?;
        Ok(Region {
            base,
            len: size.get(),
        })
    }

    fn ptr(&self) -> *mut u8 {
        self.base.as_ptr().cast()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `base..base+len` is the mapping made in `map`; every pointer into it
        // is tied to the Arc that owns this region, so none outlives it.
        if let Err(e) = unsafe { munmap(self.base, self.len) } {
            warn!("munmap of the cache store failed: {e}");
        }
    }
}

/// The system's page size, which the layout's page must be (the pins and records
/// are mapped page by page).
fn check_page_size() -> Result<(), CacheError> {
    let size = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .map_err(|e| os_error("sysconf(PAGE_SIZE)", e))?;
    match size {
        Some(size) if size as u64 == PAGE => Ok(()),
        other => Err(CacheError::Protocol(format!(
            "the cache needs pages of {PAGE} bytes; this system's are {other:?}"
        ))),
    }
}

/// The server's segment: the sealed memfd and the server's mapping of it.
pub struct Segment {
    fd: OwnedFd,
    region: Region,
}

// SAFETY: the region is a fixed MAP_SHARED mapping owned by the segment; the server
// touches only the metadata region, through atomics, and slot bytes not at all.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// A sealed memfd of `len` bytes, none of them reserved yet.
    pub fn create(len: u64) -> Result<Segment, CacheError> {
        check_page_size()?;
        let flags = MFdFlags::MFD_ALLOW_SEALING | MFdFlags::MFD_CLOEXEC;
        let fd = memfd_create(c"vrtspike-cache", flags).map_err(|e| os_error("memfd_create", e))?;
        let size = i64::try_from(len).map_err(|_| CacheError::ShmTooSmall {
            requested: len,
            available: i64::MAX as u64,
            limit: "file offsets".into(),
        })?;
        // Sets the size only: a memfd's pages are allocated when written or fallocated.
        ftruncate(&fd, size).map_err(|e| os_error("ftruncate", e))?;
        let seals = SIZE_SEALS | SealFlag::F_SEAL_SEAL;
        fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).map_err(|e| os_error("F_ADD_SEALS", e))?;
        let region = Region::map(fd.as_fd(), 0, len, Access::Write)?;
        Ok(Segment { fd, region })
    }

    /// Reserves the metadata and the pin pages of `layout` (after checking that the
    /// machine has them; no headroom is kept for this small, one-off region), writes
    /// a fresh table there and returns it with the pin pages.
    pub fn create_table(
        self: &Arc<Self>,
        layout: Layout,
    ) -> Result<(TableWriter, PinPages), CacheError> {
        if layout.total_bytes() > self.len() {
            return Err(CacheError::Protocol(format!(
                "segment of {} bytes cannot hold the layout {layout:?}",
                self.len()
            )));
        }
        let mut reserver = self.reserver(0);
        let meta_len = layout.total_bytes() - layout.meta_offset();
        reserver
            .reserve(layout.meta_offset(), meta_len)
            .map_err(|r| CacheError::ShmTooSmall {
                requested: r.needed,
                available: r.available,
                limit: r.limit,
            })?;
        let backing = Arc::clone(self) as Arc<dyn super::table::Backing>;
        // SAFETY: the metadata and the pin pages lie inside the segment (checked
        // above), start at page-aligned offsets of a page-aligned read-write mapping,
        // are reserved and zeroed (a new memfd) and touched only through atomics; the
        // Arc keeps the mapping alive.
        Ok(unsafe {
            (
                TableWriter::create(
                    self.region.ptr().add(layout.meta_offset() as usize),
                    layout,
                    backing.clone(),
                ),
                PinPages::over(
                    self.region.ptr().add(layout.pins_offset() as usize),
                    layout.connections,
                    backing,
                ),
            )
        })
    }

    /// What reserves slot ranges of this segment, keeping `headroom` bytes free.
    pub fn reserver(self: &Arc<Self>, headroom: u64) -> MemfdReserver {
        MemfdReserver {
            segment: Arc::clone(self),
            headroom,
            available: meminfo::shared_memory_available,
        }
    }

    /// The memfd, to pass to a client.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Bytes in the segment.
    pub fn len(&self) -> u64 {
        self.region.len as u64
    }

    /// Whether the segment is empty (never, for a valid store).
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
}

/// Where a [`MemfdReserver`] learns how much memory may still be taken.
pub type AvailableFn = fn() -> Result<Available, meminfo::MeminfoError>;

/// Reserves slot ranges of a segment: checks MemAvailable and the cgroup's room
/// (keeping `headroom` free), then `fallocate`s the range so its pages exist before
/// any process writes them.
pub struct MemfdReserver {
    segment: Arc<Segment>,
    headroom: u64,
    available: AvailableFn,
}

impl MemfdReserver {
    /// The same, asking `available` for the memory figures (tests).
    #[cfg(test)]
    fn with_available(mut self, available: AvailableFn) -> MemfdReserver {
        self.available = available;
        self
    }

    fn check_room(&self, len: u64) -> Result<(), ReserveRefusal> {
        let needed = len.saturating_add(self.headroom);
        match (self.available)() {
            Ok(room) if room.bytes < needed => Err(ReserveRefusal {
                needed,
                available: room.bytes,
                limit: format!("{}, keeping {} bytes free", room.limit, self.headroom),
            }),
            Ok(_) => Ok(()),
            Err(e) => {
                // fallocate below still refuses what the kernel cannot give.
                warn!("reserving cache memory without a check: {e}");
                Ok(())
            }
        }
    }
}

impl PageReserver for MemfdReserver {
    fn reserve(&mut self, offset: u64, len: u64) -> Result<(), ReserveRefusal> {
        self.check_room(len)?;
        let in_store = offset
            .checked_add(len)
            .is_some_and(|end| end <= self.segment.len());
        let range = (i64::try_from(offset), i64::try_from(len));
        let (Ok(start), Ok(count), true) = (range.0, range.1, in_store) else {
            return Err(ReserveRefusal {
                needed: len,
                available: 0,
                limit: format!("range {offset}..+{len} outside the store"),
            });
        };
        fallocate(&self.segment.fd, FallocateFlags::empty(), start, count).map_err(|e| {
            ReserveRefusal {
                needed: len,
                available: 0,
                limit: format!("fallocate of the store's memfd: {e}"),
            }
        })
    }
}

/// A client process's read-only mapping of a store, shared by all its connections,
/// and the memfd, from which each connection maps what it may write.
pub struct Mapping {
    store_id: u64,
    region: Region,
    fd: OwnedFd,
}

// SAFETY: the mapping is a fixed, read-only MAP_SHARED region that lives as long as
// `region`; threads only read the ranges of records they hold a lease on, which the
// server never hands to a writer meanwhile, and the metadata only through atomics
// (see `table`).
unsafe impl Send for Mapping {}
// SAFETY: as above; shared references only hand out raw ranges under that protocol.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps a store's memfd read-only after checking that its size is sealed at
    /// `store_len`.
    fn new(store_id: u64, fd: OwnedFd, store_len: u64) -> Result<Mapping, CacheError> {
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).map_err(|e| os_error("F_GET_SEALS", e))?;
        let seals = SealFlag::from_bits_truncate(seals);
        if !seals.contains(SIZE_SEALS) {
            return Err(CacheError::Protocol(format!(
                "the store's memfd is not sealed against resizing (seals {seals:?})"
            )));
        }
        let size = fstat(&fd).map_err(|e| os_error("fstat", e))?.st_size;
        if u64::try_from(size).ok() != Some(store_len) {
            return Err(CacheError::Protocol(format!(
                "the store's memfd has {size} bytes, the server said {store_len}"
            )));
        }
        let region = Region::map(fd.as_fd(), 0, store_len, Access::Read)?;
        Ok(Mapping {
            store_id,
            region,
            fd,
        })
    }

    /// The store this maps.
    pub fn store_id(&self) -> u64 {
        self.store_id
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// The store's table (read-only), whose metadata follows an arena of `arena_bytes`.
    pub fn table(self: &Arc<Self>, arena_bytes: u64) -> Result<Table, CacheError> {
        let meta_offset = super::table::meta_offset_after(arena_bytes);
        if meta_offset >= self.len() as u64 {
            return Err(CacheError::Protocol(format!(
                "store of {} bytes has no metadata after an arena of {arena_bytes} bytes",
                self.len()
            )));
        }
        // SAFETY: `meta_offset` is inside the mapping (checked above) and page-aligned
        // in a page-aligned mapping; the server reserved it and created atomics there,
        // and every process touches them only as atomics (this one only loads); the
        // Arc keeps the mapping alive. `attach` checks the header's sizes against the
        // mapping's length.
        let table = unsafe {
            Table::attach(
                self.region.ptr().add(meta_offset as usize),
                meta_offset,
                self.len() as u64,
                Arc::clone(self) as Arc<dyn super::table::Backing>,
            )
        }?;
        Ok(table)
    }

    /// The start of `[offset, offset + len)` for reading, checked against the
    /// mapping's bounds.
    pub fn range(&self, offset: u64, len: u64) -> Result<*const u8, CacheError> {
        let end = offset.checked_add(len);
        match end {
            Some(end) if end <= self.len() as u64 => {
                // SAFETY: offset + len is within the mapping, checked just above.
                Ok(unsafe { self.region.ptr().add(offset as usize) }.cast_const())
            }
            _ => Err(CacheError::BadGrant {
                offset,
                len,
                store_len: self.len() as u64,
            }),
        }
    }

    /// Connection page `page` of a store laid out as `layout`, mapped writable for
    /// this connection alone.
    pub fn own_page(&self, layout: &Layout, page: usize) -> Result<OwnPage, CacheError> {
        if page >= layout.connections {
            return Err(CacheError::Protocol(format!(
                "pin page {page} out of range (the store has {})",
                layout.connections
            )));
        }
        let offset = layout.pins_offset() + page as u64 * PAGE;
        if offset + PAGE > self.len() as u64 {
            return Err(CacheError::BadGrant {
                offset,
                len: PAGE,
                store_len: self.len() as u64,
            });
        }
        let region = Region::map(self.fd.as_fd(), offset, PAGE, Access::Write)?;
        Ok(OwnPage { region })
    }

    /// The extent `[offset, offset + len)` of the arena (`arena_bytes` long), mapped
    /// writable for a fill: whole pages, faulted in at once.
    pub fn fill_map(&self, offset: u64, len: u64, arena_bytes: u64) -> Result<FillMap, CacheError> {
        let bad = || CacheError::BadGrant {
            offset,
            len,
            store_len: arena_bytes,
        };
        let pages = super::table::extent_for(len).ok_or_else(bad)?;
        let inside = offset
            .checked_add(pages)
            .is_some_and(|end| end <= arena_bytes.next_multiple_of(PAGE));
        if len == 0 || offset % PAGE != 0 || !inside {
            return Err(bad());
        }
        let region = Region::map(self.fd.as_fd(), offset, pages, Access::WritePopulated)?;
        Ok(FillMap { region, len })
    }
}

/// A connection's own page of pins, mapped writable.
pub struct OwnPage {
    region: Region,
}

// SAFETY: a fixed MAP_SHARED page that lives as long as `region`, touched only
// through atomics.
unsafe impl Send for OwnPage {}
// SAFETY: as above.
unsafe impl Sync for OwnPage {}

impl OwnPage {
    /// The page's words.
    pub fn page(&self) -> PinPage<'_> {
        // SAFETY: the region is one page of PAGE_WORDS aligned words (a page-aligned
        // mapping), alive while `self` is, and only atomics touch it in any process.
        let words = unsafe {
            std::slice::from_raw_parts(
                self.region.ptr().cast::<std::sync::atomic::AtomicU64>(),
                PAGE_WORDS,
            )
        };
        PinPage::new(words)
    }
}

/// The extent of a record being filled, mapped writable until the fill ends.
pub struct FillMap {
    region: Region,
    len: u64,
}

// SAFETY: a fixed MAP_SHARED range reserved for this fill alone (the server hands it
// to no reader or other writer until the commit), alive as long as `region`.
unsafe impl Send for FillMap {}

impl FillMap {
    /// The record's bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes of the mapping (it has `len` rounded up to pages),
        // reserved for this fill alone; `&mut self` keeps this the only live slice.
        unsafe { std::slice::from_raw_parts_mut(self.region.ptr(), self.len as usize) }
    }

    /// The record's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the record is empty (never: a record has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
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

/// A store's memfd as the server sent it.
pub struct StoreFd {
    /// The memfd.
    pub fd: OwnedFd,
    /// Its size, as the server announced it.
    pub len: u64,
}

/// This process's mapping for `address`: the existing one if it is of `store_id`,
/// else a new one of `store`.
pub fn adopt(
    address: &str,
    store_id: u64,
    store: Option<StoreFd>,
) -> Result<Arc<Mapping>, CacheError> {
    let mut map = locked_registry()?;
    if let Some(existing) = map.get(address).and_then(Weak::upgrade) {
        if existing.store_id == store_id {
            return Ok(existing);
        }
    }
    let store = store.ok_or_else(|| {
        CacheError::Protocol("the server sent no store to a process that maps none".into())
    })?;
    let mapping = Arc::new(Mapping::new(store_id, store.fd, store.len)?);
    map.insert(address.to_string(), Arc::downgrade(&mapping));
    Ok(mapping)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    fn plenty() -> Result<Available, meminfo::MeminfoError> {
        Ok(Available {
            bytes: u64::MAX,
            limit: "test".into(),
        })
    }

    fn three_mb() -> Result<Available, meminfo::MeminfoError> {
        Ok(Available {
            bytes: 3 * MB,
            limit: "a 3 MiB test limit".into(),
        })
    }

    /// Pages of the memfd that hold memory, from its fstat block count.
    fn allocated(segment: &Segment) -> u64 {
        fstat(&segment.fd).unwrap().st_blocks as u64 * 512
    }

    #[test]
    fn a_new_segment_takes_no_memory_and_cannot_be_resized() {
        let segment = Arc::new(Segment::create(1 << 40).unwrap());
        assert_eq!(segment.len(), 1 << 40);
        assert_eq!(allocated(&segment), 0, "a 1 TiB store allocated pages");
        assert!(ftruncate(segment.fd(), 4096).is_err(), "shrink allowed");
        assert!(ftruncate(segment.fd(), 2 << 40).is_err(), "growth allowed");
        let mut reserver = segment.reserver(0).with_available(plenty);
        reserver.reserve(8 * MB, 2 * MB).unwrap();
        assert_eq!(allocated(&segment), 2 * MB);
    }

    #[test]
    fn reservation_checks_the_room_left_and_keeps_the_headroom() {
        let segment = Arc::new(Segment::create(16 * MB).unwrap());
        let mut reserver = segment.reserver(MB).with_available(three_mb);
        reserver.reserve(0, 2 * MB).unwrap();
        let refusal = reserver.reserve(2 * MB, 3 * MB).unwrap_err();
        assert_eq!((refusal.needed, refusal.available), (4 * MB, 3 * MB));
        assert!(
            refusal.limit.contains("3 MiB test limit"),
            "{}",
            refusal.limit
        );
        assert_eq!(allocated(&segment), 2 * MB, "a refusal reserved nothing");
        let outside = reserver.reserve(15 * MB, 2 * MB).unwrap_err();
        assert!(outside.limit.contains("outside the store"), "{outside}");
    }

    #[test]
    fn a_client_maps_only_a_sealed_memfd_of_the_announced_size() {
        let segment = Segment::create(MB).unwrap();
        let dup = || segment.fd().try_clone_to_owned().unwrap();
        let mapping = Mapping::new(7, dup(), MB).unwrap();
        assert_eq!(mapping.len() as u64, MB);
        assert!(mapping.range(MB - 10, 11).is_err());
        assert!(matches!(
            Mapping::new(7, dup(), 2 * MB),
            Err(CacheError::Protocol(_))
        ));
        let unsealed = memfd_create(c"unsealed", MFdFlags::MFD_CLOEXEC).unwrap();
        ftruncate(&unsealed, MB as i64).unwrap();
        let err = Mapping::new(7, unsealed, MB).err().unwrap();
        assert!(err.to_string().contains("not sealed"), "{err}");
    }

    /// The permissions of the mapping that holds `addr`, as /proc/self/maps shows.
    fn perms_at(addr: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        for line in maps.lines() {
            let mut parts = line.split_whitespace();
            let (range, perms) = (parts.next().unwrap(), parts.next().unwrap());
            let (a, b) = range.split_once('-').unwrap();
            let a = usize::from_str_radix(a, 16).unwrap();
            let b = usize::from_str_radix(b, 16).unwrap();
            if (a..b).contains(&addr) {
                return perms.to_string();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn a_client_maps_the_store_read_only_and_only_its_own_page_and_fill_writable() {
        let layout = Layout::for_store(MB, None);
        let segment = Arc::new(Segment::create(layout.total_bytes()).unwrap());
        let (_table, pins) = segment.create_table(layout).unwrap();
        let fd = segment.fd().try_clone_to_owned().unwrap();
        let mapping = Mapping::new(9, fd, layout.total_bytes()).unwrap();
        let addr = |offset: u64| mapping.range(offset, 8).unwrap() as usize;
        assert_eq!(perms_at(addr(0)), "r--s", "records");
        assert_eq!(
            perms_at(addr(layout.meta_offset())),
            "r--s",
            "descriptors, index"
        );
        assert_eq!(perms_at(addr(layout.pins_offset())), "r--s", "others' pins");
        let own = mapping.own_page(&layout, 3).unwrap();
        assert_eq!(perms_at(own.region.ptr() as usize), "rw-s");
        let lease = own.page().take(7).unwrap();
        assert!(pins.page(3).pins(7), "the server sees the client's lease");
        assert!(!pins.page(2).pins(7));
        assert!(pins.page(3).release(lease));
        let mut fill = mapping.fill_map(2 * PAGE, 5000, MB).unwrap();
        assert_eq!(perms_at(fill.region.ptr() as usize), "rw-s");
        assert_eq!(fill.bytes_mut().len(), 5000);
        fill.bytes_mut()[4999] = 42;
        let written = mapping.range(2 * PAGE + 4999, 1).unwrap();
        // SAFETY: one byte inside the read-only mapping (checked by `range`), which
        // lives on; the fill mapping wrote it above and nothing writes it now.
        assert_eq!(unsafe { *written }, 42);
        assert!(
            mapping.fill_map(PAGE + 1, 10, MB).is_err(),
            "not page-aligned"
        );
        assert!(
            mapping.fill_map(MB - PAGE, PAGE + 1, MB).is_err(),
            "past the arena"
        );
        assert!(mapping.fill_map(0, 0, MB).is_err(), "empty");
        assert!(mapping.own_page(&layout, layout.connections).is_err());
    }
}
