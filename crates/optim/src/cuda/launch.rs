//! The CUDA launch layer every CUDA piece of this crate launches through: [`CudaDevice`] (the
//! parameters' `CudaBackend`, the kernels loaded from this crate's PTX [`Module`]s, the device
//! buffer launch tables are copied to, a lookup-table upload, and a GradScaler's per-parameter
//! skip counters), the launch shapes (one fused launch over a piece table, PyTorch's foreach
//! passes chunk by chunk), and the addresses and checks of the tensors a launch reads.
//!
//! It sits on the step vocabulary (`step.rs`), tensor memory (`host.rs`), the piece tables
//! (`table.rs`) and headroom-ops-cuda's backend; it knows no rule.

use std::collections::HashMap;
use std::sync::Arc;

use headroom_autograd_core::{Backend, DType, Device, Tensor, TensorError};
use headroom_caching_allocator::Allocation;
use headroom_ops_cuda::{CudaBackend, CudaKernel, KernelArg, ReplayLink};

use super::table::{PieceHead, Table};
use crate::error::OptimError;
use crate::host::byte_range;
use crate::kernels::check_step;
use crate::step::{DeviceGradScaling, Scaling, StepItem};

/// A PTX module: one of this crate's, or a user's (an `ElementwiseRule`'s kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Module {
    Adam,
    Sgd,
    Adam8bit,
    Adam4bit,
    Adafactor,
    Clip,
    GradScale,
    /// PTX text under a name unique in the process.
    User {
        name: &'static str,
        ptx: &'static str,
    },
}

/// One of this crate's modules, `kernels/ptx/<file>.ptx.gz`: its name (`headroom_optim::<file>`)
/// and its PTX text (inflated once, by ops-cuda's `ptx_text`).
macro_rules! crate_module {
    ($file:literal) => {
        (
            concat!("headroom_optim::", $file),
            headroom_ops_cuda::ptx_text(include_bytes!(concat!(
                "../../kernels/ptx/",
                $file,
                ".ptx.gz"
            ))),
        )
    };
}

impl Module {
    /// The module's name (unique in the process) and its PTX text.
    fn source(self) -> (&'static str, &'static str) {
        match self {
            Module::Adam => crate_module!("adam"),
            Module::Sgd => crate_module!("sgd"),
            Module::Adam8bit => crate_module!("adam8bit"),
            Module::Adam4bit => crate_module!("adam4bit"),
            Module::Adafactor => crate_module!("adafactor"),
            Module::Clip => crate_module!("clip"),
            Module::GradScale => crate_module!("grad_scale"),
            Module::User { name, ptx } => (name, ptx),
        }
    }
}

/// The instance of a kernel template for parameters of `dtype`, among its f32, bf16 and f16
/// instances `names` (`kernels/optim.cuh`'s `INSTANCES`); the optimizer admits no other dtype.
pub(crate) fn instance(dtype: DType, names: [&'static str; 3]) -> &'static str {
    match dtype {
        DType::BF16 => names[1],
        DType::F16 => names[2],
        _ => names[0],
    }
}

/// The device address of a contiguous tensor's first element.
pub(crate) fn address(tensor: &Tensor) -> u64 {
    byte_range(tensor).start
}

/// The device addresses a kernel reads a GradScaler's scale and flag from (0: none).
pub(crate) fn scaling_addresses(scaling: Scaling<'_>) -> (u64, u64) {
    match scaling {
        Scaling::None | Scaling::Host(_) => (0, 0),
        Scaling::Device(DeviceGradScaling {
            grad_scale,
            found_inf,
        }) => (
            grad_scale.as_ref().map_or(0, address),
            found_inf.as_ref().map_or(0, address),
        ),
    }
}

/// The device addresses of a GradScaler's scale and flag for a raw-buffer step (0: none),
/// after checking each tensor as the optimizers do: one contiguous f32 element of `device`'s
/// backend, whose stream the launch runs on (so the allocator frees it after the launch).
pub(crate) fn checked_scaling_addresses(
    device: &CudaDevice,
    op: &'static str,
    scaling: Option<&DeviceGradScaling>,
) -> Result<(u64, u64), OptimError> {
    let Some(scaling) = scaling else {
        return Ok((0, 0));
    };
    for tensor in scaling.grad_scale.iter().chain(&scaling.found_inf) {
        if !device.owns(tensor) {
            return Err(OptimError::MixedDevices {
                op,
                expected: device.device(),
                got: tensor.device(),
            });
        }
        if tensor.dtype() != DType::F32 {
            return Err(OptimError::DType {
                op,
                expected: DType::F32,
                got: tensor.dtype(),
            });
        }
        if tensor.numel() != 1 || !tensor.is_contiguous() {
            return Err(OptimError::InvalidArgument {
                op,
                reason: format!(
                    "a gradient scale or found-inf flag is one f32 element, not {:?}",
                    tensor.shape()
                ),
            });
        }
    }
    Ok(scaling_addresses(Scaling::Device(scaling)))
}

/// Checks that the byte ranges `(address, bytes)` a raw-buffer launch writes are not null and
/// do not overlap (two parameters sharing a state buffer would race in the kernel).
pub(crate) fn check_disjoint(
    op: &'static str,
    ranges: impl Iterator<Item = (u64, u64)>,
) -> Result<(), OptimError> {
    let mut ranges: Vec<(u64, u64)> = ranges.filter(|&(_, bytes)| bytes > 0).collect();
    if ranges.iter().any(|&(address, _)| address == 0) {
        return Err(OptimError::InvalidArgument {
            op,
            reason: "a buffer of a non-empty parameter has the null address".into(),
        });
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let (first, second) = (pair[0], pair[1]);
        if first.0.saturating_add(first.1) > second.0 {
            return Err(OptimError::InvalidArgument {
                op,
                reason: format!(
                    "the buffers at {:#x} ({} bytes) and {:#x} ({} bytes) overlap; every \
                     parameter and state buffer a step writes must be its own memory",
                    first.0, first.1, second.0, second.1
                ),
            });
        }
    }
    Ok(())
}

fn device_error(op: &'static str, error: impl std::fmt::Display) -> OptimError {
    OptimError::Tensor(TensorError::Device {
        op,
        reason: error.to_string(),
    })
}

/// What the CUDA device of an optimizer keeps between steps: its backend, loaded kernels, the
/// buffer launch tables are copied to, the 8-bit lookup tables, and the per-parameter counters
/// of steps skipped on the device.
///
/// Public only as the device a [`CudaKernels`](crate::rule::CudaKernels) entry takes; nothing
/// outside this crate can name or make one.
#[derive(Debug)]
pub struct CudaDevice {
    backend: Arc<CudaBackend>,
    n_slots: usize,
    /// Loaded kernels by module and kernel name.
    kernels: HashMap<(&'static str, &'static str), CudaKernel>,
    table: Option<Allocation>,
    /// Tables written inside CUDA graph captures (each its own block of the graph's pool, which
    /// nothing outside that capture reuses); freed at the next table written outside one.
    captured_tables: Vec<Allocation>,
    /// The steps launched inside captures, whose replays the host's step numbers follow.
    pub(super) captured_steps: Vec<CapturedSteps>,
    code_tables: Option<Allocation>,
    skips: Option<Allocation>,
}

/// `param`'s backend as headroom-ops-cuda's, or a typed error naming `op`.
pub(crate) fn cuda_backend_of(
    op: &'static str,
    param: &Tensor,
) -> Result<Arc<CudaBackend>, OptimError> {
    param
        .backend()
        .clone()
        .into_any()
        .downcast::<CudaBackend>()
        .map_err(|_| OptimError::UnsupportedTensor {
            op,
            reason: format!(
                "a {:?} tensor of a backend other than headroom-ops-cuda's",
                param.device()
            ),
        })
}

impl CudaDevice {
    /// The device of `param`, a tensor of a `CudaBackend`, for `n_slots` parameters.
    pub(crate) fn of(
        op: &'static str,
        param: &Tensor,
        n_slots: usize,
    ) -> Result<CudaDevice, OptimError> {
        Ok(CudaDevice::new(cuda_backend_of(op, param)?, n_slots))
    }

    /// The device of `backend` for `n_slots` parameters.
    pub(crate) fn new(backend: Arc<CudaBackend>, n_slots: usize) -> CudaDevice {
        CudaDevice {
            backend,
            n_slots,
            kernels: HashMap::new(),
            table: None,
            captured_tables: Vec::new(),
            captured_steps: Vec::new(),
            code_tables: None,
            skips: None,
        }
    }

    pub(crate) fn device(&self) -> Device {
        self.backend.device()
    }

    pub(crate) fn backend(&self) -> &Arc<CudaBackend> {
        &self.backend
    }

    /// Whether `tensor` lives on this backend (whose stream and allocator the kernels use).
    pub(crate) fn owns(&self, tensor: &Tensor) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(tensor.backend()), Arc::as_ptr(&self.backend))
    }

    /// Copies a launch table to the device (in stream order, without waiting) and returns its
    /// address; the buffer grows when needed and is kept for the next steps. Inside a CUDA graph
    /// capture the table gets a block of its own, which every replay copies the same bytes into:
    /// for tables that hold no per-step value (the step-dependent launches refuse a capture in
    /// [`CudaDevice::table_args`] or read the replay index).
    pub(crate) fn write_table(&mut self, bytes: &[u8]) -> Result<u64, OptimError> {
        let needed = bytes.len() as u64;
        if self.backend.is_capturing() {
            let table = self
                .backend
                .allocator()
                .allocate(needed.max(1), headroom_caching_allocator::StreamId::DEFAULT)
                .map_err(TensorError::from)?;
            let address = table.address();
            self.captured_tables.push(table);
            // SAFETY: the block is live, at least `bytes.len()` long, and stays allocated in the
            // graph's pool (kept in `captured_tables`, then cached under the pool) while the
            // graph lives.
            unsafe { self.backend.write_for_replays(address, bytes) }?;
            return Ok(address);
        }
        for table in self.captured_tables.drain(..) {
            self.backend
                .allocator()
                .free(table)
                .map_err(TensorError::from)?;
        }
        if self.table.as_ref().is_none_or(|t| t.size() < needed) {
            if let Some(old) = self.table.take() {
                self.backend
                    .allocator()
                    .free(old)
                    .map_err(TensorError::from)?;
            }
            let size = needed.max(4096).next_power_of_two();
            self.table = Some(
                self.backend
                    .allocator()
                    .allocate(size, headroom_caching_allocator::StreamId::DEFAULT)
                    .map_err(TensorError::from)?,
            );
        }
        let table = self.table.as_ref().expect("allocated above");
        // SAFETY: the allocation is live and at least `bytes.len()` long; kernels queued before
        // read the previous table, and the copy runs after them in stream order.
        unsafe { self.backend.write_async(table.address(), bytes) }?;
        Ok(table.address())
    }

    /// Writes the table of a one-pass launch (`n_pieces` pieces) and returns the two arguments
    /// every piece-table kernel starts with: the table's address and its number of pieces.
    /// Refuses a CUDA graph capture: such a table holds the step's number and constants (see
    /// [`CudaDevice::run_elementwise_replayed`] for the kernels that read them from the replay).
    pub(crate) fn table_args(
        &mut self,
        table: &Table,
        n_pieces: usize,
    ) -> Result<[KernelArg; 2], OptimError> {
        self.refuse_capture("optimizer step")?;
        let base = self.write_table(table.bytes())?;
        Ok([KernelArg::U64(base), KernelArg::U32(n_pieces as u32)])
    }

    /// Refuses a CUDA graph capture for `op`, whose launch table holds the step's number (and
    /// constants derived from it) and so changes every step; `Ok` outside a capture.
    pub(crate) fn refuse_capture(&self, op: &'static str) -> Result<(), OptimError> {
        self.backend
            .refuse_capture(
                op,
                "writes its step number into a launch table on the host (only fused Adam and \
                 AdamW with gradients scaled on the device read it from a graph's replay)",
            )
            .map_err(OptimError::from)
    }

    /// Launches kernel `name` of `module` with `grid` blocks of `block` threads.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number, order and type, and every address in
    /// them (and in the tables they point to) must be live memory of this backend.
    pub(crate) unsafe fn launch(
        &mut self,
        module: Module,
        name: &'static str,
        grid: u32,
        block: u32,
        args: &[KernelArg],
    ) -> Result<(), OptimError> {
        let (module_name, ptx) = module.source();
        let key = (module_name, name);
        let kernel = match self.kernels.get(&key) {
            Some(kernel) => kernel,
            None => {
                let kernel = self
                    .backend
                    .load_kernel(module_name, ptx, name)
                    .map_err(|e| device_error("load_kernel", e))?;
                self.kernels.entry(key).or_insert(kernel)
            }
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.backend.launch_kernel(kernel, grid, block, 0, args) }?;
        Ok(())
    }

    /// The address of `slot`'s skip counter; with `create`, the counters are allocated (zeroed)
    /// on first use, else 0 while there are none.
    pub(crate) fn skip_counter(&mut self, slot: usize, create: bool) -> Result<u64, OptimError> {
        if self.skips.is_none() && create {
            let zeros = vec![0u8; self.n_slots.max(1) * 4];
            self.skips = Some(self.backend.upload(&zeros)?);
        }
        Ok(self
            .skips
            .as_ref()
            .map_or(0, |skips| skips.address() + slot as u64 * 4))
    }

    /// The steps each slot skipped on the device (waits for the device).
    pub(crate) fn skipped_steps(&self, n_slots: usize) -> Result<Vec<u64>, OptimError> {
        let Some(skips) = &self.skips else {
            return Ok(vec![0; n_slots]);
        };
        let mut bytes = vec![0u8; n_slots * 4];
        // SAFETY: the counters hold `self.n_slots` (= n_slots) i32s.
        unsafe { self.backend.download(skips.address(), &mut bytes) }?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64)
            .collect())
    }

    /// Drops the skip counters (the host's step numbers are exact again).
    pub(crate) fn reset_skip_counters(&mut self) -> Result<(), OptimError> {
        if let Some(skips) = self.skips.take() {
            self.backend
                .allocator()
                .free(skips)
                .map_err(TensorError::from)?;
        }
        Ok(())
    }

    /// The address of the 8-bit lookup tables, uploaded on first use from `bytes()` (the same
    /// bytes every time: `cuda/adam8bit.rs`'s `code_table_bytes`).
    pub(crate) fn code_tables(&mut self, bytes: fn() -> Vec<u8>) -> Result<u64, OptimError> {
        if self.code_tables.is_none() {
            self.code_tables = Some(self.backend.upload(&bytes())?);
        }
        Ok(self.code_tables.as_ref().expect("uploaded above").address())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let allocations = [
            self.table.take(),
            self.code_tables.take(),
            self.skips.take(),
        ];
        let captured = std::mem::take(&mut self.captured_tables);
        for allocation in allocations.into_iter().flatten().chain(captured) {
            // Freed in stream order; a failure cannot be reported from a drop (the backend
            // counts failed frees of its own, this one is lost).
            let _ = self.backend.allocator().free(allocation);
        }
    }
}

/// The slots of a step launched inside a capture, and the replays the host already counted (the
/// host counted the captured step itself, as the first replay).
#[derive(Debug)]
pub(crate) struct CapturedSteps {
    pub(super) link: ReplayLink,
    pub(super) slots: Vec<usize>,
    pub(super) counted: u64,
}

impl CapturedSteps {
    pub(crate) fn new(link: ReplayLink, slots: impl Iterator<Item = usize>) -> CapturedSteps {
        let slots = slots.collect();
        CapturedSteps {
            link,
            slots,
            counted: 1,
        }
    }
}

/// Blocks of `block_elems` elements that cover `len` elements.
pub(crate) fn blocks_for(len: usize, block_elems: u64) -> u64 {
    (len as u64).div_ceil(block_elems)
}

/// Elements per block of a fused launch over `total_len` elements whose kernel takes at most
/// `max_elems` a block with `threads` threads: about a thousand blocks when the launch is small
/// (a bucket of an in-backward step: at `max_elems` a 4 Mi-element bucket would fill half of an
/// H200's multiprocessors, each block streaming alone), never above `max_elems`, a multiple of
/// four elements a thread (one float4 each, so that every block starts aligned). The update is
/// elementwise, so the split changes no result.
pub(crate) fn fused_block_elems(total_len: usize, (max_elems, threads): (u64, u32)) -> u64 {
    let round = 4 * u64::from(threads);
    (total_len as u64 / 1024)
        .next_multiple_of(round)
        .clamp(round, max_elems.max(round))
}

/// Threads per block of the foreach passes.
const PASS_THREADS: u32 = 256;

/// Elements per block of the foreach passes over chunks of `chunk_len` elements: about a
/// thousand blocks per launch (a 16 MiB chunk fills the GPU once), at least 4 Ki and at most
/// 64 Ki elements, a multiple of 2 Ki (one round of two float4 per thread).
pub(crate) fn pass_block_elems(chunk_len: usize) -> u64 {
    (chunk_len as u64 / 1024)
        .clamp(4096, 65536)
        .next_multiple_of(2048)
}

/// Writes a pass piece: `(table, tensor index, element range, temporary address, first block)`.
pub(crate) type PassPieceWriter<'a> =
    dyn FnMut(&mut Table, usize, std::ops::Range<usize>, u64, u64) + 'a;

/// One launch over a table region: its offset in the table, pieces and blocks.
#[derive(Debug, Clone, Copy)]
struct Region {
    offset: usize,
    n_pieces: usize,
    n_blocks: u64,
}

pub(super) fn grid(n_blocks: u64) -> Result<u32, OptimError> {
    u32::try_from(n_blocks).map_err(|_| OptimError::InvalidArgument {
        op: "launch",
        reason: format!("{n_blocks} blocks exceed a CUDA grid"),
    })
}

impl CudaDevice {
    /// One launch of an elementwise multi-tensor kernel (`(table, n_pieces, block_elems,
    /// grad_scale, found_inf)`) over the pieces of `table`, `n_blocks` blocks in all; the scale
    /// and flag are device addresses (0: none).
    pub(crate) fn run_elementwise(
        &mut self,
        kernel: (Module, &'static str),
        table: &Table,
        n_pieces: usize,
        n_blocks: u64,
        (block_elems, threads): (u64, u32),
        (grad_scale, found_inf): (u64, u64),
    ) -> Result<(), OptimError> {
        if n_pieces == 0 {
            return Ok(());
        }
        let [table_at, n_pieces] = self.table_args(table, n_pieces)?;
        let args = [
            table_at,
            n_pieces,
            KernelArg::U64(block_elems),
            KernelArg::U64(grad_scale),
            KernelArg::U64(found_inf),
        ];
        // SAFETY: every elementwise kernel of this crate takes these five parameters; the table
        // was just written, and its addresses are live tensors of the step (checked by the
        // optimizer), as are the scale and flag tensors.
        unsafe { self.launch(kernel.0, kernel.1, grid(n_blocks)?, threads, &args) }
    }

    /// PyTorch's foreach passes: `ops` of `kernel` (`(table, n_pieces, block_elems, op)`), each
    /// one launch over all pieces of a chunk, over tensors of `lens` elements cut into chunks of
    /// at most `chunk_len`; with `with_scratch`, each piece's temporaries are its slice of one
    /// scratch tensor of `chunk_len` elements allocated from `like`'s backend (freed when the
    /// passes are queued; of `like`'s dtype), else its temporary address is 0.
    /// `write_piece(table, tensor index, element range, scratch address, first block)` writes a
    /// piece's entry.
    pub(crate) fn run_passes(
        &mut self,
        kernel: (Module, &'static str),
        like: &Tensor,
        lens: &[usize],
        (chunk_len, with_scratch): (usize, bool),
        ops: &[i32],
        write_piece: &mut PassPieceWriter<'_>,
    ) -> Result<(), OptimError> {
        let chunks = crate::kernels::foreach_chunks(lens, chunk_len)?;
        if chunks.is_empty() || ops.is_empty() {
            return Ok(());
        }
        let scratch = match with_scratch {
            true => Some(crate::host::scratch(like, chunk_len)?),
            false => None,
        };
        let scratch_base = scratch.as_ref().map_or(0, address);
        let elem = like.dtype().size_in_bytes() as u64;
        let block_elems = pass_block_elems(chunk_len);
        let mut table = Table::default();
        let mut regions = Vec::with_capacity(chunks.len());
        for chunk in &chunks {
            let offset = table.len();
            let (mut first_block, mut tmp_offset) = (0u64, 0u64);
            for (idx, range) in chunk {
                let len = range.len();
                let tmp = match scratch {
                    Some(_) => scratch_base + tmp_offset * elem,
                    None => 0,
                };
                write_piece(&mut table, *idx, range.clone(), tmp, first_block);
                first_block += blocks_for(len, block_elems);
                tmp_offset += len as u64;
            }
            regions.push(Region {
                offset,
                n_pieces: chunk.len(),
                n_blocks: first_block,
            });
        }
        self.refuse_capture("optimizer step (foreach)")?;
        let base = self.write_table(table.bytes())?;
        for region in regions {
            for &op in ops {
                let args = [
                    KernelArg::U64(base + region.offset as u64),
                    KernelArg::U32(region.n_pieces as u32),
                    KernelArg::U64(block_elems),
                    KernelArg::I32(op),
                ];
                // SAFETY: the pass kernels take these four parameters; the table region was
                // written above, its addresses are live tensors of the step and slices of the
                // scratch, which stays allocated until every pass is queued (its reuse after the
                // free is stream-ordered).
                unsafe {
                    self.launch(
                        kernel.0,
                        kernel.1,
                        grid(region.n_blocks)?,
                        PASS_THREADS,
                        &args,
                    )
                }?;
            }
        }
        drop(scratch);
        Ok(())
    }
}

/// What a rule's CUDA step needs to know of each of its parameters.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ItemGeometry {
    /// Elements.
    pub(crate) len: usize,
    /// Index among the optimizer's parameters (its skip counter).
    pub(crate) slot: usize,
    /// The host's step number.
    pub(crate) step: u64,
}

impl CudaDevice {
    /// The table of a one-pass launch: one piece per parameter (`write(table, index, head)`
    /// writes it), each starting at the block after the previous one's blocks of `block_elems`
    /// elements, its skip counter set when `count_skips` (a device scaling may skip the step);
    /// with the launch's number of blocks.
    pub(crate) fn piece_table(
        &mut self,
        items: &[ItemGeometry],
        block_elems: u64,
        count_skips: bool,
        write: &mut dyn FnMut(&mut Table, usize, PieceHead),
    ) -> Result<(Table, u64), OptimError> {
        let mut table = Table::default();
        let mut first_block = 0;
        for (idx, item) in items.iter().enumerate() {
            let head = PieceHead {
                len: item.len as u64,
                first_block,
                skipped: self.skip_counter(item.slot, count_skips)?,
                step: item.step,
            };
            write(&mut table, idx, head);
            first_block += blocks_for(item.len, block_elems);
        }
        Ok((table, first_block))
    }

    /// The fused form: one piece per parameter (`write(table, index, head)` writes it), one
    /// launch of `kernel` with `block` = (most elements, threads) per block (fewer elements a
    /// block for a small launch: [`fused_block_elems`]).
    ///
    /// With `replayed`, `kernel` takes a replay index ([`CudaDevice::run_elementwise_replayed`]):
    /// inside a CUDA graph capture the launch is recorded, so the host's step numbers of its
    /// slots follow the graph's replays ([`CudaDevice::replay_deltas`]). A host-valued gradient
    /// scale is baked into the table, so it refuses the capture.
    pub(crate) fn run_fused(
        &mut self,
        kernel: (Module, &'static str),
        items: &[ItemGeometry],
        block: (u64, u32),
        (scaling, replayed): (Scaling<'_>, bool),
        write: &mut dyn FnMut(&mut Table, usize, PieceHead),
    ) -> Result<(), OptimError> {
        let total_len = items.iter().map(|item| item.len).sum();
        let block = (fused_block_elems(total_len, block), block.1);
        let count_skips = matches!(scaling, Scaling::Device(_));
        let (table, n_blocks) = self.piece_table(items, block.0, count_skips, write)?;
        let addresses = scaling_addresses(scaling);
        if !replayed {
            return self.run_elementwise(kernel, &table, items.len(), n_blocks, block, addresses);
        }
        if matches!(scaling, Scaling::Host(_)) {
            self.refuse_capture("optimizer step with a host-valued gradient scale")?;
        }
        let launch = (&table, items.len(), n_blocks);
        match self.run_elementwise_replayed(kernel, launch, block, addresses)? {
            Some(link) => {
                // A graph captured before would replay step numbers this one counts too.
                for earlier in &self.captured_steps {
                    if !earlier.link.same_graph(&link) {
                        earlier.link.invalidate(
                            "a newer graph captured the optimizer's step; replay that one",
                        );
                    }
                }
                self.captured_steps
                    .push(CapturedSteps::new(link, items.iter().map(|item| item.slot)));
            }
            // A step outside the graph moves the step numbers its replays would start from.
            None => self.invalidate_captures(
                "the optimizer stepped outside the graph after its step was captured",
            ),
        }
        Ok(())
    }

    /// The foreach form (chunks of `chunk` elements, `None`: all at once) or the single form
    /// (one parameter at a time, with a temporary of its size) of `ops` of `kernel`;
    /// `write(table, index, element range, temporary address, first block)` writes a piece.
    pub(crate) fn run_unfused(
        &mut self,
        kernel: (Module, &'static str),
        like: &Tensor,
        lens: &[usize],
        foreach_chunk: Option<Option<usize>>,
        ops: &PassOps,
        write: &mut PassPieceWriter<'_>,
    ) -> Result<(), OptimError> {
        let total: usize = lens.iter().sum();
        match foreach_chunk {
            Some(chunk) => {
                let chunk_len = chunk.map_or(total, |c| c.min(total));
                self.run_passes(kernel, like, lens, (total, false), &ops.whole, write)?;
                self.run_passes(kernel, like, lens, (chunk_len, true), &ops.chunked, write)
            }
            None => {
                let all: Vec<i32> = ops.whole.iter().chain(&ops.chunked).copied().collect();
                for (idx, &len) in lens.iter().enumerate() {
                    self.run_passes(
                        kernel,
                        like,
                        &[len],
                        (len, true),
                        &all,
                        &mut |t, _, r, tmp, b| write(t, idx, r, tmp, b),
                    )?;
                }
                Ok(())
            }
        }
    }
}

/// The ops of one foreach step, in launch order: those that need no temporary run first, each
/// one launch over whole tensors; the others then run chunk by chunk, with the chunk's slice of
/// the scratch. (Ops on different arrays commute, so each element still sees its operations in
/// the CPU's order.)
#[derive(Debug, Clone, Default)]
pub(crate) struct PassOps {
    pub(crate) whole: Vec<i32>,
    pub(crate) chunked: Vec<i32>,
}

/// The raw-buffer layer's parameters of `lens` elements, all at step `step` (no skip counters),
/// once `step` is checked ([`check_step`]).
pub(crate) fn raw_geometry(
    op: &'static str,
    lens: impl Iterator<Item = usize>,
    step: u64,
) -> Result<Vec<ItemGeometry>, OptimError> {
    check_step(op, step)?;
    Ok(lens
        .map(|len| ItemGeometry { len, slot: 0, step })
        .collect())
}

/// The parameters of a rule's step as the CUDA side needs them.
pub(crate) fn geometry<S>(items: &[StepItem<'_, S>]) -> Vec<ItemGeometry> {
    items
        .iter()
        .map(|it| ItemGeometry {
            len: it.param.numel(),
            slot: it.slot,
            step: it.step,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::fused_block_elems;

    /// A whole model keeps the kernel's largest block; a bucket of an in-backward step gets
    /// about a thousand blocks; every size is whole float4 rounds of the block's threads.
    #[test]
    fn fused_blocks_shrink_for_small_launches_only() {
        let adam = (1 << 16, 512);
        assert_eq!(fused_block_elems(304_000_000, adam), 1 << 16);
        // ViT-L/16's fc2 weight and biases: 684 blocks instead of 65.
        let bucket = 4 * 1024 * 1024 + 5120;
        let elems = fused_block_elems(bucket, adam);
        assert_eq!(elems, 6144);
        assert_eq!((bucket as u64).div_ceil(elems), 684);
        assert_eq!(fused_block_elems(10, adam), 2048);
        assert_eq!(fused_block_elems(10, (4096, 256)), 1024);
        assert_eq!(fused_block_elems(1 << 30, (4096, 256)), 4096);
    }
}
