//! Launches of `kernels/index.cu`: gather, scatter-add, fused cross-entropy (whole rows, and the
//! tiles of a chunked loss), dropout and random fills (the counter-based draws dropout shares).
//!
//! Index and target checks happen on the device: kernels skip an out-of-range index and record
//! it in an error word, which is read back after the launch (one small synchronous read through
//! `small_copies.rs`) and returned as `TensorError::InvalidArgument`, as the CPU backend reports it —
//! or, with deferred checks, kept in the backend's slots and returned by the next
//! synchronisation. Scratch memory
//! (the error word, per-row losses) comes from the caching allocator and goes back to it in
//! stream order. [`CudaBackend::synchronize`] lives here because it is where deferred checks
//! report: it waits for the device, then returns a pending deferred error.
//!
//! This family sits on the ground floor (strided operands of `operands.rs`, shared with
//! elementwise kernels there) and imports no other family.

use cudarc::driver::{result, LaunchConfig};
use headroom_autograd_core::{
    cross_entropy_tile_dims, index_strides, CrossEntropyArgs, CrossEntropyBackward,
    CrossEntropyForward, CrossEntropyTile, CrossEntropyTileBackward, DType, Distribution,
    DropoutDraw, LogitTile, RandomDraw, Reduction, Result, TensorError, View,
};
use headroom_caching_allocator::StreamId;

use crate::device::CudaBackend;
use crate::error::device_error;
use crate::kernels::{float_suffix, Module};
use crate::launch::{launch_in, Param, NO_ARGS};
use crate::operands::{element_address, launch_strided, strided_args};
use crate::scratch::Scratch;

/// The error word's value when nothing went wrong.
const NO_ERROR: u64 = u64::MAX;
const THREADS: u32 = 256;

/// The ops with index or target checks, in the order of the deferred error slots.
const CHECKED_OPS: [&str; 3] = ["gather", "scatter_add", "cross_entropy"];

/// Where a launch's kernels record the first out-of-range value they skip: a fresh word read back
/// right after the launch (immediate checks, the default), or the backend's slot for the op, read
/// at the next synchronisation (deferred checks, [`CudaBackend::set_deferred_index_checks`]).
enum ErrorWord<'a> {
    Fresh(Scratch<'a>),
    Deferred(u64),
}

impl ErrorWord<'_> {
    fn address(&self) -> u64 {
        match self {
            ErrorWord::Fresh(word) => word.address(),
            ErrorWord::Deferred(address) => *address,
        }
    }
}

/// Sets `bytes` bytes at `address` to [`NO_ERROR`]'s all-ones pattern, in stream order.
fn clear_words(backend: &CudaBackend, op: &'static str, address: u64, bytes: usize) -> Result<()> {
    backend.bind(op)?;
    // SAFETY: the caller passes live device memory of this backend at least `bytes` long; the
    // default stream orders the memset before the kernels that use it.
    unsafe { result::memset_d8_async(address, 0xff, bytes, backend.stream.cu_stream()) }
        .map_err(|e| device_error(op, e))
}

/// The error word for a launch of `op`.
fn error_word<'a>(backend: &'a CudaBackend, op: &'static str) -> Result<ErrorWord<'a>> {
    if let Some(slots) = backend.deferred_index_checks.lock().as_ref() {
        let slot = CHECKED_OPS.iter().position(|&name| name == op).unwrap_or(0);
        return Ok(ErrorWord::Deferred(slots.address() + 8 * slot as u64));
    }
    let word = Scratch::new(backend, 8)?;
    clear_words(backend, op, word.address(), 8)?;
    Ok(ErrorWord::Fresh(word))
}

/// Reads a fresh error word back; `Err` naming the first out-of-range value if a kernel set it.
/// A deferred word is checked later, by [`CudaBackend::take_deferred_index_error`].
fn check_error_word(
    backend: &CudaBackend,
    op: &'static str,
    word: &ErrorWord<'_>,
    what: impl FnOnce(i64) -> String,
) -> Result<()> {
    let ErrorWord::Fresh(word) = word else {
        return Ok(());
    };
    backend
        .capture
        .refuse(op, "reads its index check's error word on the host")?;
    let mut bytes = [0u8; 8];
    // SAFETY: the word is live and 8 bytes; the read runs after the kernels that write it.
    unsafe { backend.read_back(op, word.address(), &mut bytes) }?;
    let value = u64::from_le_bytes(bytes);
    if value == NO_ERROR {
        Ok(())
    } else {
        Err(TensorError::InvalidArgument {
            op,
            reason: what(value as i64),
        })
    }
}

impl CudaBackend {
    /// Waits until every launched kernel has finished; then returns the error of a deferred index
    /// check, if one is pending (see [`CudaBackend::set_deferred_index_checks`]).
    pub fn synchronize(&self) -> Result<()> {
        self.capture
            .refuse("synchronize", "waits on the host for the device")?;
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronize", e))?;
        self.take_deferred_index_error()
    }

    /// Defers the index checks of gather, scatter-add (embedding backward) and cross-entropy
    /// (targets): instead of reading an error word back after every launch — one host
    /// synchronisation per call, the default — the kernels record the first out-of-range value per
    /// op in the backend's slots, and the next [`CudaBackend::synchronize`], `read_host` or
    /// [`CudaBackend::take_deferred_index_error`] returns it as `TensorError::InvalidArgument`
    /// (and clears it). Either way an out-of-range index is skipped, never read or written; with
    /// deferred checks the error arrives later, as CUDA's own asynchronous errors do in PyTorch.
    /// Switching back to immediate checks first returns any error still pending.
    pub fn set_deferred_index_checks(&self, deferred: bool) -> Result<()> {
        if deferred == self.deferred_index_checks.lock().is_some() {
            return Ok(());
        }
        if deferred {
            let bytes = 8 * CHECKED_OPS.len();
            let slots = self.allocator().allocate(bytes as u64, StreamId::DEFAULT)?;
            if let Err(error) =
                clear_words(self, "set_deferred_index_checks", slots.address(), bytes)
            {
                self.free_quietly(slots);
                return Err(error);
            }
            *self.deferred_index_checks.lock() = Some(slots);
            Ok(())
        } else {
            let pending = self.take_deferred_index_error();
            if let Some(slots) = self.deferred_index_checks.lock().take() {
                self.free_quietly(slots);
            }
            pending
        }
    }

    /// Whether index checks are deferred (see [`CudaBackend::set_deferred_index_checks`]).
    pub fn deferred_index_checks(&self) -> bool {
        self.deferred_index_checks.lock().is_some()
    }

    /// The first out-of-range index or target a deferred check recorded since the last call, as
    /// `TensorError::InvalidArgument` naming the op; clears the record. `Ok` when checks are
    /// immediate or nothing was out of range. Waits for the queued kernels.
    pub fn take_deferred_index_error(&self) -> Result<()> {
        let op = "take_deferred_index_error";
        self.capture
            .refuse(op, "reads the deferred index checks on the host")?;
        let guard = self.deferred_index_checks.lock();
        let Some(slots) = guard.as_ref() else {
            return Ok(());
        };
        let mut bytes = [0u8; 8 * CHECKED_OPS.len()];
        // SAFETY: the slots are a live allocation of `8 · CHECKED_OPS.len()` bytes; the read runs
        // after the kernels that write them.
        unsafe { self.read_back(op, slots.address(), &mut bytes) }?;
        let values: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|word| u64::from_le_bytes(word.try_into().expect("8-byte chunks")))
            .collect();
        let Some(slot) = values.iter().position(|&v| v != NO_ERROR) else {
            return Ok(());
        };
        clear_words(self, op, slots.address(), 8 * CHECKED_OPS.len())?;
        let what = if CHECKED_OPS[slot] == "cross_entropy" {
            "target"
        } else {
            "index"
        };
        Err(TensorError::InvalidArgument {
            op: CHECKED_OPS[slot],
            reason: format!(
                "{what} {} is out of bounds (found by a deferred check; the kernel skipped it)",
                values[slot] as i64
            ),
        })
    }
}

fn index_kernel(
    backend: &CudaBackend,
    op: &'static str,
    data: View<'_>,
    dim: usize,
    index: View<'_>,
    other: View<'_>,
) -> Result<()> {
    let strides = index_strides(op, &data, dim, &index, &other)?;
    if data.dtype != other.dtype {
        return Err(TensorError::DtypeMismatch {
            op,
            lhs: data.dtype,
            rhs: other.dtype,
        });
    }
    let suffix = float_suffix(op, data.dtype)?;
    let zeroed = headroom_autograd_core::Layout::from_parts(
        index.layout.shape(),
        &strides,
        data.layout.offset(),
    )?;
    let data_view = View {
        buffer: data.buffer,
        layout: &zeroed,
        dtype: data.dtype,
    };
    let args = strided_args(op, &[&other, &index, &data_view])?;
    if args.numel == 0 {
        return Ok(());
    }
    let limit = data.layout.shape()[dim] as i64;
    let word = error_word(backend, op)?;
    let params = [
        Param::U64(data.buffer.address()),
        Param::U64(index.buffer.address()),
        Param::U64(other.buffer.address()),
        Param::U64(data.layout.strides()[dim] as u64),
        Param::I64(limit),
        Param::U64(word.address()),
    ];
    let name = (op, suffix);
    launch_strided(backend, Module::Index, op, name, args, &params)?;
    check_error_word(backend, op, &word, |bad| {
        format!("index {bad} is out of bounds for size {limit}")
    })
}

/// `out[..i..] = x[..index[..i..]..]` along `dim`.
pub(crate) fn gather(
    backend: &CudaBackend,
    x: View<'_>,
    dim: usize,
    index: View<'_>,
    out: View<'_>,
) -> Result<()> {
    index_kernel(backend, "gather", x, dim, index, out)
}

/// `dst[..index[..i..]..] += src[..i..]` along `dim` (atomic adds).
pub(crate) fn scatter_add(
    backend: &CudaBackend,
    dst: View<'_>,
    dim: usize,
    index: View<'_>,
    src: View<'_>,
) -> Result<()> {
    index_kernel(backend, "scatter_add", dst, dim, index, src)
}

fn ce_shape(args: &CrossEntropyArgs<'_>) -> Result<(u64, u64)> {
    let [rows, classes] = *args.logits.layout.shape() else {
        return Err(TensorError::InvalidArgument {
            op: "cross_entropy",
            reason: "logits must be [rows, classes]".into(),
        });
    };
    if !args.logits.layout.is_contiguous()
        || args.target.layout.shape() != [rows]
        || args.target.dtype != DType::I64
    {
        return Err(TensorError::ShapeMismatch {
            op: "cross_entropy",
            lhs: args.logits.layout.shape().to_vec(),
            rhs: args.target.layout.shape().to_vec(),
        });
    }
    Ok((rows as u64, classes as u64))
}

fn ce_suffix(op: &'static str, logits: DType, stats: DType) -> Result<&'static str> {
    Ok(match (logits, stats) {
        (DType::F32, DType::F32) => "f32_f32",
        (DType::F64, DType::F64) => "f64_f64",
        (DType::F16, DType::F32) => "f16_f32",
        (DType::BF16, DType::F32) => "bf16_f32",
        (_, stats) => return Err(TensorError::UnsupportedDtype { op, dtype: stats }),
    })
}

/// Whether the loss (or its gradient) `loss` of `logits` is f32 while the logits are f16 or bf16
/// (the loss of upcast logits, computed without the f32 copy); otherwise it must have the logits'
/// dtype.
fn upcast_loss(op: &'static str, logits: DType, loss: DType) -> Result<bool> {
    match (logits, loss) {
        (logits, loss) if logits == loss => Ok(false),
        (DType::F16 | DType::BF16, DType::F32) => Ok(true),
        (_, loss) => Err(TensorError::UnsupportedDtype { op, dtype: loss }),
    }
}

fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn row_blocks(rows: u64) -> LaunchConfig {
    let blocks = rows.clamp(1, 132 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn cross_entropy(backend: &CudaBackend, forward: CrossEntropyForward<'_>) -> Result<()> {
    let CrossEntropyForward {
        input: args,
        loss,
        lse,
    } = forward;
    let op = "cross_entropy";
    let (rows, classes) = ce_shape(&args)?;
    let suffix = ce_suffix(op, args.logits.dtype, lse.dtype)?;
    upcast_loss(op, args.logits.dtype, loss.dtype)?;
    let total_suffix = float_suffix(op, loss.dtype)?;
    let word = error_word(backend, op)?;
    let row_loss = Scratch::new(backend, rows * 8)?;
    let row_valid = Scratch::new(backend, rows * 8)?;
    let params = [
        Param::U64(element_address(&args.logits)),
        Param::U64(element_address(&args.target)),
        Param::U64(args.target.layout.strides()[0] as u64),
        Param::I64(args.ignore_index),
        Param::U64(element_address(&lse)),
        Param::U64(row_loss.address()),
        Param::U64(row_valid.address()),
        Param::U64(word.address()),
        Param::U64(rows),
        Param::U64(classes),
    ];
    if rows > 0 {
        let name = ("ce_rows", suffix);
        launch_in(
            backend,
            Module::Index,
            op,
            name,
            row_blocks(rows),
            &params,
            NO_ARGS,
        )?;
    }
    let mean = i32::from(args.reduction == Reduction::Mean);
    let params = [
        Param::U64(row_loss.address()),
        Param::U64(row_valid.address()),
        Param::U64(rows),
        Param::I32(mean),
        Param::U64(element_address(&loss)),
    ];
    let name = ("ce_total", total_suffix);
    launch_in(
        backend,
        Module::Index,
        op,
        name,
        one_block(),
        &params,
        NO_ARGS,
    )?;
    check_error_word(backend, op, &word, |bad| {
        format!("target {bad} is out of bounds for {classes} classes")
    })
}

pub(crate) fn cross_entropy_backward(
    backend: &CudaBackend,
    backward: CrossEntropyBackward<'_>,
) -> Result<()> {
    let CrossEntropyBackward {
        input: args,
        lse,
        dloss,
        dlogits,
    } = backward;
    let op = "cross_entropy_backward";
    let (rows, classes) = ce_shape(&args)?;
    if dlogits.layout.shape() != args.logits.layout.shape() || !dlogits.layout.is_contiguous() {
        return Err(TensorError::ShapeMismatch {
            op,
            lhs: args.logits.layout.shape().to_vec(),
            rhs: dlogits.layout.shape().to_vec(),
        });
    }
    let suffix = match (
        ce_suffix(op, args.logits.dtype, lse.dtype)?,
        upcast_loss(op, args.logits.dtype, dloss.dtype)?,
    ) {
        ("f16_f32", true) => "f16_f32_gf32",
        ("bf16_f32", true) => "bf16_f32_gf32",
        (suffix, _) => suffix,
    };
    let count = Scratch::new(backend, 8)?;
    let target = element_address(&args.target);
    let target_stride = args.target.layout.strides()[0] as u64;
    let params = [
        Param::U64(target),
        Param::U64(target_stride),
        Param::I64(args.ignore_index),
        Param::U64(rows),
        Param::U64(count.address()),
    ];
    launch_in(
        backend,
        Module::Index,
        op,
        ("ce_count", ""),
        one_block(),
        &params,
        NO_ARGS,
    )?;
    if rows * classes == 0 {
        return Ok(());
    }
    let params = [
        Param::U64(element_address(&args.logits)),
        Param::U64(target),
        Param::U64(target_stride),
        Param::I64(args.ignore_index),
        Param::U64(element_address(&lse)),
        Param::U64(element_address(&dloss)),
        Param::U64(count.address()),
        Param::I32(i32::from(args.reduction == Reduction::Mean)),
        Param::U64(element_address(&dlogits)),
        Param::U64(rows),
        Param::U64(classes),
    ];
    let name = ("ce_backward", suffix);
    launch_in(
        backend,
        Module::Index,
        op,
        name,
        row_blocks(rows),
        &params,
        NO_ARGS,
    )
}

/// Launches the tile kernel `family` (`rows_per_block` rows a block) after the tiles' shape rule: its leading
/// parameters (the tile's logits, width and first class, the targets, their stride and
/// `ignore_index`), then `rest`, then the row count. An empty tile launches nothing.
fn launch_tile(
    backend: &CudaBackend,
    kernel: (&'static str, &'static str, u64),
    tile: &LogitTile<'_>,
    per_row: &[&View<'_>],
    rest: &[Param],
) -> Result<()> {
    let (rows, n) = cross_entropy_tile_dims(kernel.0, tile, per_row)?;
    let (logits, target) = (&tile.logits, &tile.target);
    let at = ForeignLogitTile {
        dtype: logits.dtype,
        logits: element_address(logits),
        rows,
        width: n,
        class_start: tile.class_start,
        labels: element_address(target),
        label_stride: target.layout.strides()[0],
        ignore_index: tile.ignore_index,
    };
    launch_tile_at(backend, kernel, &at, rest)
}

/// [`launch_tile`] on a tile already checked (or described by raw addresses).
fn launch_tile_at(
    backend: &CudaBackend,
    (op, family, rows_per_block): (&'static str, &'static str, u64),
    tile: &ForeignLogitTile,
    rest: &[Param],
) -> Result<()> {
    if tile.rows == 0 || tile.width == 0 {
        return Ok(());
    }
    let mut params = vec![
        Param::U64(tile.logits),
        Param::U64(tile.width as u64),
        Param::U64(tile.class_start as u64),
        Param::U64(tile.labels),
        Param::U64(tile.label_stride as u64),
        Param::I64(tile.ignore_index),
    ];
    params.extend_from_slice(rest);
    params.push(Param::U64(tile.rows as u64));
    let name = (family, float_suffix(op, tile.dtype)?);
    let config = row_blocks((tile.rows as u64).div_ceil(rows_per_block));
    launch_in(backend, Module::Index, op, name, config, &params, NO_ARGS)
}

/// One tile of a chunked cross-entropy's logits in device memory that Headroom does not own
/// (a PyTorch tensor's, handed over by address): the tile kernels that
/// `linear_cross_entropy` runs, for hosts that compute the tiles' products themselves. See
/// [`CudaBackend::cross_entropy_tile_at`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ForeignLogitTile {
    /// The logits' element type: f32, f64, f16 or bf16. The per-row statistics are f32 (f64 for
    /// f64 logits).
    pub dtype: DType,
    /// Device address of the dense row-major `[rows, width]` logits.
    pub logits: u64,
    /// Rows of the tile.
    pub rows: usize,
    /// Classes of the tile: `class_start..class_start + width`.
    pub width: usize,
    /// The class of the tile's first column.
    pub class_start: usize,
    /// Device address of each row's class (i64), row `r`'s at `labels + 8 · r · label_stride`.
    pub labels: u64,
    /// Elements between two rows' classes.
    pub label_stride: usize,
    /// Rows whose class is this contribute nothing (their statistics are not read back here).
    pub ignore_index: i64,
}

/// Device addresses of a tile's per-row statistics, `rows` values each in the statistics dtype
/// (f32; f64 for f64 logits), read and written by [`CudaBackend::cross_entropy_tile_at`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForeignTileStats {
    /// Each row's running maximum: −∞ before its first tile.
    pub row_max: u64,
    /// Each row's running sum of `exp(z − row_max)`: 0 before its first tile.
    pub row_sum: u64,
    /// Each row's target logit, written by the tile that holds the target's class.
    pub target_logit: u64,
}

/// Device addresses of what [`CudaBackend::cross_entropy_tile_backward_at`] reads per row, in the
/// statistics dtype: the log-sum-exp over every class, and the row's share `g` of the loss's
/// gradient (the tile becomes `g · (softmax − onehot)`; 0 for an ignored row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForeignTileGradient {
    /// Each row's log-sum-exp.
    pub lse: u64,
    /// Each row's share of the loss's gradient.
    pub scale: u64,
}

fn check_foreign(op: &'static str, tile: &ForeignLogitTile, addresses: &[u64]) -> Result<()> {
    if !tile.dtype.is_float() {
        return Err(TensorError::UnsupportedDtype {
            op,
            dtype: tile.dtype,
        });
    }
    if tile.rows > 0 && tile.width > 0 && addresses.contains(&0) {
        return Err(TensorError::InvalidArgument {
            op,
            reason: format!(
                "a null address for a tile of {} × {} logits",
                tile.rows, tile.width
            ),
        });
    }
    Ok(())
}

/// A foreign tile at least this wide and with fewer rows than [`WIDE_TILE_ROWS`] is folded one
/// block a row (`ce_tile_wide`) instead of one warp a row: few long rows (a block of whole rows
/// of a large vocabulary) leave a warp a row waiting on its loads. The tiles of Headroom's own
/// `linear_cross_entropy` and the wheel's tiled loss (thousands of rows of at most a few thousand
/// classes) keep the warp a row.
const WIDE_TILE_WIDTH: usize = 8192;
/// See [`WIDE_TILE_WIDTH`].
const WIDE_TILE_ROWS: usize = 8192;

impl CudaBackend {
    /// Folds one tile of logits into each row's running maximum and sum of exponentials, and
    /// writes the target's logit of the rows whose class the tile holds: the forward of
    /// `linear_cross_entropy`'s tiles (one warp a row, or one block a row for a tile of fewer
    /// than 8,192 rows of at least 8,192 classes; 16-byte loads where the tile's width and
    /// address allow), on the backend's stream. After a row's last tile its log-sum-exp is
    /// `row_max + ln(row_sum)`. A class outside `0..classes` is not checked here: it is simply
    /// in no tile.
    ///
    /// # Safety
    /// Every address must be device memory of this backend's device, live until the launch has
    /// run in stream order, of the sizes and dtypes [`ForeignLogitTile`] and [`ForeignTileStats`]
    /// describe; the statistics must not overlap the logits or the labels.
    pub unsafe fn cross_entropy_tile_at(
        &self,
        tile: &ForeignLogitTile,
        stats: &ForeignTileStats,
    ) -> Result<()> {
        let op = "cross_entropy_tile";
        check_foreign(
            op,
            tile,
            &[
                tile.logits,
                tile.labels,
                stats.row_max,
                stats.row_sum,
                stats.target_logit,
            ],
        )?;
        let rest = [
            Param::U64(stats.row_max),
            Param::U64(stats.row_sum),
            Param::U64(stats.target_logit),
            Param::U64(0),
        ];
        let kernel = if tile.width >= WIDE_TILE_WIDTH && tile.rows < WIDE_TILE_ROWS {
            (op, "ce_tile_wide", 1)
        } else {
            (op, "ce_tile", u64::from(THREADS / 32))
        };
        launch_tile_at(self, kernel, tile, &rest)
    }

    /// Overwrites one tile of logits, recomputed, with their gradient
    /// `scale · (softmax − onehot(target))` (computed in the statistics dtype, rounded once into
    /// the logits' dtype): the backward of `linear_cross_entropy`'s tiles, one block a row, on
    /// the backend's stream, without label smoothing or z-loss.
    ///
    /// # Safety
    /// As [`CudaBackend::cross_entropy_tile_at`]: live device memory of this backend of the
    /// described sizes, `gradient`'s vectors not overlapping the logits.
    pub unsafe fn cross_entropy_tile_backward_at(
        &self,
        tile: &ForeignLogitTile,
        gradient: &ForeignTileGradient,
    ) -> Result<()> {
        let op = "cross_entropy_tile_backward";
        check_foreign(
            op,
            tile,
            &[tile.logits, tile.labels, gradient.lse, gradient.scale],
        )?;
        let rest = [
            Param::U64(tile.width as u64),
            Param::F64(0.0),
            Param::U64(gradient.lse),
            Param::U64(gradient.scale),
            Param::U64(gradient.scale),
        ];
        launch_tile_at(self, (op, "ce_tile_backward", 1), tile, &rest)
    }
}

pub(crate) fn cross_entropy_tile(backend: &CudaBackend, args: CrossEntropyTile<'_>) -> Result<()> {
    let mut per_row = vec![&args.row_max, &args.row_sum, &args.target_logit];
    per_row.extend(args.logit_sum.as_ref());
    let rest = [
        Param::U64(element_address(&args.row_max)),
        Param::U64(element_address(&args.row_sum)),
        Param::U64(element_address(&args.target_logit)),
        Param::U64(args.logit_sum.as_ref().map_or(0, element_address)),
    ];
    launch_tile(
        backend,
        // One warp a row.
        ("cross_entropy_tile", "ce_tile", u64::from(THREADS / 32)),
        &args.tile,
        &per_row,
        &rest,
    )
}

pub(crate) fn cross_entropy_tile_backward(
    backend: &CudaBackend,
    args: CrossEntropyTileBackward<'_>,
) -> Result<()> {
    let rest = [
        Param::U64(args.classes as u64),
        Param::F64(args.smoothing),
        Param::U64(element_address(&args.lse)),
        Param::U64(element_address(&args.scale)),
        Param::U64(element_address(&args.factor)),
    ];
    launch_tile(
        backend,
        ("cross_entropy_tile_backward", "ce_tile_backward", 1),
        &args.tile,
        &[&args.lse, &args.scale, &args.factor],
        &rest,
    )
}

pub(crate) fn dropout(
    backend: &CudaBackend,
    x: View<'_>,
    draw: DropoutDraw,
    out: View<'_>,
    mask: View<'_>,
) -> Result<()> {
    let op = "dropout";
    backend.capture.refuse(
        op,
        "draws its seed on the host (a replay would repeat one mask); capture without dropout",
    )?;
    let dense = |v: &View<'_>| v.layout.is_contiguous() && v.layout.offset() == 0;
    if !dense(&out) || !dense(&mask) || out.layout.shape() != x.layout.shape() {
        return Err(TensorError::InvalidArgument {
            op,
            reason: "out and mask must be fresh dense tensors of x's shape".into(),
        });
    }
    if !matches!(mask.dtype, DType::Bool | DType::U8) || out.dtype != x.dtype {
        return Err(TensorError::DtypeMismatch {
            op,
            lhs: x.dtype,
            rhs: out.dtype,
        });
    }
    let suffix = float_suffix(op, x.dtype)?;
    let args = strided_args(op, &[&out, &x])?;
    if args.numel == 0 {
        return Ok(());
    }
    let params = [
        Param::U64(x.buffer.address()),
        Param::U64(out.buffer.address()),
        Param::U64(mask.buffer.address()),
        Param::F64(draw.p),
        Param::U64(draw.seed),
        Param::U64(draw.offset),
    ];
    let name = (op, suffix);
    launch_strided(backend, Module::Index, op, name, args, &params)
}

/// Fills `dst` with `draw`'s values (autograd-core's [`RandomDraw::value`], rounded to the
/// dtype): one grid-stride kernel over `dst`'s elements in row-major order.
pub(crate) fn random(backend: &CudaBackend, dst: View<'_>, draw: RandomDraw) -> Result<()> {
    let op = "random";
    backend.capture.refuse(
        op,
        "draws its seed on the host (a replay would repeat the same values); fill before capture",
    )?;
    let suffix = float_suffix(op, dst.dtype)?;
    let args = strided_args(op, &[&dst])?;
    if args.numel == 0 {
        return Ok(());
    }
    let (normal, a, b) = match draw.distribution {
        Distribution::Uniform { low, high } => (0, low, high),
        Distribution::Normal { mean, std } => (1, mean, std),
    };
    let params = [
        Param::U64(dst.buffer.address()),
        Param::I32(normal),
        Param::F64(a),
        Param::F64(b),
        Param::U64(draw.seed),
        Param::U64(draw.offset),
    ];
    launch_strided(backend, Module::Index, op, (op, suffix), args, &params)
}
