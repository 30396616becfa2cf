//! The device side of offload: the pool's pinned chunks and copy streams, one entry per
//! offloaded storage (its place: lent to its copy to the host, on the host, coming back, on the
//! device), the groups that chain the prefetch, and the pack and unpack hooks.
//!
//! Ordering, all on the device: a copy to the host waits for the compute stream's work queued
//! before it (ops-cuda's `copy_from_tensor_in_flight`); the compute stream waits for that copy
//! before the storage is given back (`InFlight::finish`, or its drop), and for a copy back
//! before the storage's first use. A pinned range is handed out again only after every range
//! was freed: the copy back that read it was waited for by the compute stream (or it was never
//! copied back, and the last use was a copy to the host on the same stream), and the next copy
//! into it waits for the compute stream. The host only ever queries an event.
//!
//! Locks: an entry's place, then the pool's state, never the other way around; an `Arc<Entry>`
//! is never dropped while the pool's state is locked (its drop locks it).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use headroom_autograd_core::{
    saved_tensor_hooks, BackendRef, Buffer, DType, Device, Packed, SaveSite, Tensor, TensorError,
};
use headroom_ops_cuda::{CudaBackend, CudaStream, InFlight, PinnedBuffer};

use super::{needs_cuda, offloads, OffloadOptions, OffloadStats};
use crate::error::CheckpointError;

/// Ranges start at multiples of this many bytes.
const RANGE_ALIGN: usize = 512;
/// The first chunk's size; each next chunk is as large as all before it, up to `MAX_CHUNK`.
const MIN_CHUNK: usize = 64 << 20;
const MAX_CHUNK: usize = 1 << 30;

/// An [`OffloadPool`](super::OffloadPool)'s shared state.
#[derive(Default)]
pub(super) struct Pool {
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    /// The device, from the first tensor offloaded.
    device: Option<Arc<DeviceSide>>,
    chunks: Vec<PinnedBuffer>,
    /// The next free byte: chunk and offset.
    cursor: (usize, usize),
    /// Ranges handed out and not freed.
    live_ranges: usize,
    /// Entries whose device memory may still be lent to their copy to the host, in copy order,
    /// with the position of the group that made them.
    in_flight: VecDeque<(u64, Weak<Entry>)>,
    /// Entries by storage (the `Buffer`'s address), for saves that share a storage.
    by_storage: HashMap<usize, StorageKey>,
    next_position: u64,
    last_group: Weak<Group>,
    stats: OffloadStats,
}

/// Which storage, at which version and dtype, an entry holds.
struct StorageKey {
    /// Keeps the address from being reused by another storage while the key exists.
    buffer: Weak<Buffer>,
    version: u64,
    dtype: DType,
    entry: Weak<Entry>,
}

/// The device a pool copies from and its two copy streams.
struct DeviceSide {
    backend: Arc<CudaBackend>,
    backend_ref: BackendRef,
    to_host: CudaStream,
    to_device: CudaStream,
}

/// One offloaded storage.
struct Entry {
    pool: Arc<Pool>,
    device: Arc<DeviceSide>,
    /// The `Buffer`'s address, its key in `by_storage`.
    key: usize,
    chunk: usize,
    offset: usize,
    /// Bytes of the storage.
    bytes: usize,
    /// Bytes of its pinned range.
    range_bytes: usize,
    dtype: DType,
    place: Mutex<Place>,
}

/// Where an entry's storage is.
enum Place {
    /// Lent to its copy to the host (its device memory is not given back yet).
    ToHost(InFlight),
    /// On the host only.
    OnHost,
    /// Being copied back into a new device tensor.
    ToDevice(InFlight),
    /// Copied back, and the compute stream waited for the copy.
    OnDevice(Tensor),
    /// Its copy to the host was still lent the device memory when backward needed it: used there.
    Stayed(InFlight),
}

/// What [`Entry::give_back`] did.
#[derive(PartialEq, Eq)]
enum GiveBack {
    Done,
    /// The copy is still running (and the caller would not wait for it).
    Running,
    /// The device memory is not lent to a copy any more.
    NotLent,
}

/// One run of a region or a block: its saves, and its place in the prefetch chain.
struct Group {
    pool: Arc<Pool>,
    position: u64,
    /// The group that ran before it.
    prev: Weak<Group>,
    prefetch: usize,
    entries: Mutex<Vec<Weak<Entry>>>,
    /// Its copies back have been started.
    restored: AtomicBool,
    /// Backward has unpacked one of its saves (and started the prefetch).
    reached: AtomicBool,
}

/// What the pack hook keeps for one save.
struct Holder {
    group: Arc<Group>,
    saved: Saved,
}

enum Saved {
    Kept(Tensor),
    Offloaded {
        entry: Arc<Entry>,
        shape: Vec<usize>,
        strides: Vec<usize>,
        offset: usize,
    },
}

/// Runs `run` as a new group of `options`' pool (see the parent module).
pub(super) fn run_group(
    options: &OffloadOptions,
    offload: bool,
    run: impl FnOnce() -> Result<Vec<Tensor>, TensorError>,
) -> Result<Vec<Tensor>, CheckpointError> {
    let pool = Arc::clone(&options.pool.shared);
    let group = pool.new_group(options.prefetch_blocks);
    let outputs = {
        let packing = Arc::clone(&group);
        let options = options.clone();
        let _hooks = saved_tensor_hooks(
            move |site, tensor| pack(&packing, &options, offload, site, tensor),
            unpack,
        );
        run()
    };
    let given_back = match group
        .position
        .checked_sub(options.release_after_blocks as u64)
    {
        Some(position) => pool.give_back_through(position),
        None => Ok(()),
    };
    let outputs = outputs.map_err(CheckpointError::from_engine)?;
    given_back?;
    Ok(outputs)
}

fn pack(
    group: &Arc<Group>,
    options: &OffloadOptions,
    offload: bool,
    site: &SaveSite,
    tensor: Tensor,
) -> Result<Packed, TensorError> {
    if offload && !matches!(site.device, Device::Cuda(_)) {
        return Err(needs_cuda(site.device).into_tensor_error());
    }
    group.pool.give_back_completed()?;
    if !(offload && offloads(site, tensor.buffer().len_bytes(), options)) {
        group.pool.state.lock().stats.kept_saves += 1;
        return Ok(Box::new(Holder {
            group: Arc::clone(group),
            saved: Saved::Kept(tensor),
        }));
    }
    let entry = group
        .pool
        .offload(&tensor, group.position)
        .map_err(CheckpointError::into_tensor_error)?;
    group.entries.lock().push(Arc::downgrade(&entry));
    Ok(Box::new(Holder {
        group: Arc::clone(group),
        saved: Saved::Offloaded {
            entry,
            shape: tensor.shape().to_vec(),
            strides: tensor.strides().to_vec(),
            offset: tensor.layout().offset(),
        },
    }))
}

fn unpack(packed: &Packed) -> Result<Tensor, TensorError> {
    let holder = packed
        .downcast_ref::<Holder>()
        .expect("offload's hooks unpack only what they packed");
    holder.group.reached()?;
    match &holder.saved {
        Saved::Kept(tensor) => Ok(tensor.clone()),
        Saved::Offloaded {
            entry,
            shape,
            strides,
            offset,
        } => entry.device_tensor()?.as_strided(shape, strides, *offset),
    }
}

impl Pool {
    pub(super) fn stats(&self) -> OffloadStats {
        self.state.lock().stats
    }

    fn new_group(self: &Arc<Self>, prefetch: usize) -> Arc<Group> {
        let mut state = self.state.lock();
        let position = state.next_position;
        state.next_position += 1;
        let group = Arc::new(Group {
            pool: Arc::clone(self),
            position,
            prev: state.last_group.clone(),
            prefetch,
            entries: Mutex::default(),
            restored: AtomicBool::new(false),
            reached: AtomicBool::new(false),
        });
        state.last_group = Arc::downgrade(&group);
        group
    }

    /// The entry holding `tensor`'s storage: an existing one (another save of the same storage,
    /// unchanged since), or a new one whose copy to the host is queued now.
    fn offload(
        self: &Arc<Self>,
        tensor: &Tensor,
        position: u64,
    ) -> Result<Arc<Entry>, CheckpointError> {
        let buffer = tensor.buffer();
        let key = Arc::as_ptr(buffer) as usize;
        let version = buffer.version();
        let dtype = tensor.dtype();
        let mut state = self.state.lock();
        if let Some(known) = state.by_storage.get(&key) {
            if known.buffer.as_ptr() == Arc::as_ptr(buffer)
                && known.version == version
                && known.dtype == dtype
            {
                if let Some(entry) = known.entry.upgrade() {
                    state.stats.offloaded_saves += 1;
                    drop(state);
                    return Ok(entry);
                }
            }
        }
        let device = state.device_for(tensor)?;
        let bytes = buffer.len_bytes();
        let flat = tensor.as_strided(&[bytes / dtype.size_in_bytes()], &[1], 0)?;
        let (chunk, offset, range_bytes) = state.take_range(&device.backend, bytes)?;
        let copy = device.backend.copy_from_tensor_in_flight(
            flat,
            &mut state.chunks[chunk],
            offset,
            &device.to_host,
        );
        let copy = match copy {
            Ok(copy) => copy,
            Err(err) => {
                state.free_range(range_bytes);
                return Err(err.into());
            }
        };
        let entry = Arc::new(Entry {
            pool: Arc::clone(self),
            device,
            key,
            chunk,
            offset,
            bytes,
            range_bytes,
            dtype,
            place: Mutex::new(Place::ToHost(copy)),
        });
        state
            .in_flight
            .push_back((position, Arc::downgrade(&entry)));
        state.by_storage.insert(
            key,
            StorageKey {
                buffer: Arc::downgrade(buffer),
                version,
                dtype,
                entry: Arc::downgrade(&entry),
            },
        );
        let stats = &mut state.stats;
        stats.offloaded_saves += 1;
        stats.bytes_to_host += bytes as u64;
        stats.bytes_in_flight += bytes as u64;
        Ok(entry)
    }

    /// Gives back the device memory of every entry, made by a group at `position` or before, still
    /// lent to its copy to the host: the compute stream waits for the copy.
    fn give_back_through(&self, position: u64) -> Result<(), TensorError> {
        loop {
            let front = match self.state.lock().in_flight.front() {
                Some((made_at, entry)) if *made_at <= position => entry.clone(),
                _ => return Ok(()),
            };
            if let Some(entry) = front.upgrade() {
                entry.give_back(true)?;
            }
            self.pop_in_flight(&front);
        }
    }

    /// Gives back the device memory of the entries whose copies to the host have completed, in
    /// copy order, up to the first one still running (an event query: the host does not wait).
    fn give_back_completed(&self) -> Result<(), TensorError> {
        loop {
            let front = match self.state.lock().in_flight.front() {
                Some((_, entry)) => entry.clone(),
                None => return Ok(()),
            };
            if let Some(entry) = front.upgrade() {
                if entry.give_back(false)? == GiveBack::Running {
                    return Ok(());
                }
            }
            self.pop_in_flight(&front);
        }
    }

    fn pop_in_flight(&self, entry: &Weak<Entry>) {
        let mut state = self.state.lock();
        if state
            .in_flight
            .front()
            .is_some_and(|(_, front)| front.ptr_eq(entry))
        {
            state.in_flight.pop_front();
        }
    }
}

impl PoolState {
    /// The pool's device, set from `tensor` the first time.
    fn device_for(&mut self, tensor: &Tensor) -> Result<Arc<DeviceSide>, CheckpointError> {
        let backend = Arc::clone(tensor.backend())
            .into_any()
            .downcast::<CudaBackend>()
            .map_err(|_| CheckpointError::OffloadNeedsCuda {
                reason: format!(
                    "a tensor on {:?} is not a CudaBackend's (a wrapped backend?)",
                    tensor.device()
                ),
            })?;
        if let Some(device) = &self.device {
            if !Arc::ptr_eq(&device.backend, &backend) {
                return Err(CheckpointError::InvalidArgument {
                    op: "offload",
                    reason: format!(
                        "the pool copies from {:?} and a tensor is on another CUDA backend; use \
                         one OffloadPool per device",
                        device.backend_ref.device()
                    ),
                });
            }
            return Ok(Arc::clone(device));
        }
        let device = Arc::new(DeviceSide {
            to_host: backend.new_stream()?,
            to_device: backend.new_stream()?,
            backend_ref: Arc::clone(tensor.backend()),
            backend,
        });
        self.device = Some(Arc::clone(&device));
        Ok(device)
    }

    /// A pinned range of `bytes`: the next one in the chunks, or the start of a new chunk.
    /// Returns the chunk, the offset and the range's length.
    fn take_range(
        &mut self,
        backend: &Arc<CudaBackend>,
        bytes: usize,
    ) -> Result<(usize, usize, usize), TensorError> {
        let len = bytes.next_multiple_of(RANGE_ALIGN);
        let (mut chunk, mut offset) = self.cursor;
        loop {
            match self.chunks.get(chunk) {
                Some(pinned) if offset + len <= pinned.len() => break,
                Some(_) => (chunk, offset) = (chunk + 1, 0),
                None => {
                    let capacity: usize = self.chunks.iter().map(PinnedBuffer::len).sum();
                    let size = capacity.clamp(MIN_CHUNK, MAX_CHUNK).max(len);
                    let pinned = backend.pinned_host(size)?;
                    self.stats.pinned_allocations += 1;
                    self.stats.pinned_bytes += pinned.allocated_bytes();
                    self.chunks.push(pinned);
                    (chunk, offset) = (self.chunks.len() - 1, 0);
                    break;
                }
            }
        }
        self.cursor = (chunk, offset + len);
        self.live_ranges += 1;
        self.stats.pinned_in_use += len as u64;
        Ok((chunk, offset, len))
    }

    /// Frees a range; once none is left, ranges are handed out from the start again.
    fn free_range(&mut self, range_bytes: usize) {
        self.live_ranges -= 1;
        self.stats.pinned_in_use -= range_bytes as u64;
        if self.live_ranges == 0 {
            self.cursor = (0, 0);
        }
    }
}

impl Entry {
    /// Gives the device memory back if it is still lent to the copy to the host: after making
    /// the compute stream wait for the copy if `wait`, else only if the copy has completed.
    fn give_back(&self, wait: bool) -> Result<GiveBack, TensorError> {
        let mut place = self.place.lock();
        let Place::ToHost(copy) = &*place else {
            return Ok(GiveBack::NotLent);
        };
        let completed = copy.is_done()?;
        if !(wait || completed) {
            return Ok(GiveBack::Running);
        }
        let Place::ToHost(copy) = std::mem::replace(&mut *place, Place::OnHost) else {
            unreachable!("matched above");
        };
        drop(copy.finish()?);
        drop(place);
        let mut state = self.pool.state.lock();
        state.stats.bytes_in_flight -= self.bytes as u64;
        if completed {
            state.stats.completed_releases += 1;
        } else {
            state.stats.ordered_releases += 1;
        }
        Ok(GiveBack::Done)
    }

    /// Starts the copy back to the device if the storage is on the host only; keeps it where it
    /// is if its copy to the host still has the device memory.
    fn start_restore(&self) -> Result<(), TensorError> {
        let mut place = self.place.lock();
        match std::mem::replace(&mut *place, Place::OnHost) {
            Place::OnHost => {
                let numel = self.bytes / self.dtype.size_in_bytes();
                let flat = Tensor::empty(&self.device.backend_ref, &[numel], self.dtype)?;
                let mut state = self.pool.state.lock();
                let copy = self.device.backend.copy_to_tensor_in_flight(
                    &state.chunks[self.chunk],
                    self.offset,
                    flat,
                    &self.device.to_device,
                )?;
                state.stats.bytes_to_device += self.bytes as u64;
                *place = Place::ToDevice(copy);
            }
            Place::ToHost(copy) => {
                *place = Place::Stayed(copy);
                let mut state = self.pool.state.lock();
                state.stats.bytes_in_flight -= self.bytes as u64;
                state.stats.bytes_used_in_place += self.bytes as u64;
            }
            other => *place = other,
        }
        Ok(())
    }

    /// The whole storage on the device, ready for the compute stream.
    fn device_tensor(&self) -> Result<Tensor, TensorError> {
        self.start_restore()?;
        let mut place = self.place.lock();
        let (res, next) = match std::mem::replace(&mut *place, Place::OnHost) {
            Place::ToDevice(copy) => {
                let tensor = copy.finish()?;
                (tensor.clone(), Place::OnDevice(tensor))
            }
            Place::OnDevice(tensor) => (tensor.clone(), Place::OnDevice(tensor)),
            Place::Stayed(copy) => (copy.tensor().clone(), Place::Stayed(copy)),
            Place::OnHost | Place::ToHost(_) => unreachable!("start_restore moved it"),
        };
        *place = next;
        Ok(res)
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let place = std::mem::replace(self.place.get_mut(), Place::OnHost);
        let lent = matches!(place, Place::ToHost(_));
        // An `InFlight` orders the release of its device memory after its copy.
        drop(place);
        let mut state = self.pool.state.lock();
        if lent {
            state.stats.bytes_in_flight -= self.bytes as u64;
        }
        state.free_range(self.range_bytes);
        let this: *const Entry = self;
        if state
            .by_storage
            .get(&self.key)
            .is_some_and(|known| known.entry.as_ptr() == this)
        {
            state.by_storage.remove(&self.key);
        }
    }
}

impl Group {
    /// Backward needs one of this group's saves: the first time, start the copies back of this
    /// group and of the `prefetch` groups before it.
    fn reached(&self) -> Result<(), TensorError> {
        if self.reached.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.restore()?;
        let mut prev = self.prev.upgrade();
        for _ in 0..self.prefetch {
            let Some(group) = prev else {
                break;
            };
            group.restore()?;
            prev = group.prev.upgrade();
        }
        Ok(())
    }

    /// Starts the copies back of this group's storages, last saved first.
    fn restore(&self) -> Result<(), TensorError> {
        if self.restored.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let entries: Vec<Arc<Entry>> = self
            .entries
            .lock()
            .iter()
            .rev()
            .filter_map(Weak::upgrade)
            .collect();
        entries.iter().try_for_each(|entry| entry.start_restore())
    }
}
