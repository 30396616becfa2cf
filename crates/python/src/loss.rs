//! `headroom._native`'s cross-entropy tiles: headroom-ops-cuda's kernels of the chunked
//! linear cross-entropy (`CudaBackend::cross_entropy_tile_at` and its backward) on the memory
//! of torch's tensors, which `headroom.torch.linear_cross_entropy` hands over by address after
//! computing each tile's logits with torch's own matrix products. One launch a tile on torch's
//! default stream (checked). The Python side checks every tensor (CUDA, dense, dtypes, sizes)
//! before its address comes here; this side checks the dtype's name, null addresses and the
//! stream.

use headroom_ops_cuda::{CudaBackend, ForeignLogitTile, ForeignTileGradient, ForeignTileStats};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::device::{backend, float_dtype, on_default_stream};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cross_entropy_tile, m)?)?;
    m.add_function(wrap_pyfunction!(cross_entropy_tile_backward, m)?)?;
    Ok(())
}

const STREAM_RULE: &str = "headroom.torch.linear_cross_entropy runs Headroom's kernels on \
                           torch's default stream; under `with torch.cuda.stream(...)` it uses \
                           torch's kernels instead";

/// A tile as Python passes it: `(dtype, logits, rows, width, class_start, labels, label_stride,
/// ignore_index)` — the tile `[rows, width]` of `dtype` at `logits` (classes from
/// `class_start`), row `r`'s class at `labels + 8·r·label_stride`.
type TileArgs = (String, u64, usize, usize, usize, u64, usize, i64);

fn foreign_tile(
    (dtype, logits, rows, width, class_start, labels, label_stride, ignore_index): TileArgs,
) -> PyResult<ForeignLogitTile> {
    Ok(ForeignLogitTile {
        dtype: float_dtype(&dtype, "taken by the cross-entropy tile kernels")?,
        logits,
        rows,
        width,
        class_start,
        labels,
        label_stride,
        ignore_index,
    })
}

/// Runs `launch` on device `device`'s backend once the tile is read and the stream checked.
fn on_device(
    device: usize,
    stream: u64,
    tile: TileArgs,
    launch: impl FnOnce(&CudaBackend, &ForeignLogitTile) -> headroom_autograd_core::Result<()>,
) -> PyResult<()> {
    let tile = foreign_tile(tile)?;
    on_default_stream(stream, STREAM_RULE)?;
    let backend = backend(device)?;
    launch(&backend, &tile).map_err(|error| PyValueError::new_err(error.to_string()))
}

/// Folds the tile into each row's running maximum, sum of exponentials and target logit (f32
/// vectors of `rows`; f64 for float64 logits) on CUDA device `device`.
#[pyfunction]
#[pyo3(signature = (device, stream, tile, row_max, row_sum, target_logit))]
fn cross_entropy_tile(
    device: usize,
    stream: u64,
    tile: TileArgs,
    row_max: u64,
    row_sum: u64,
    target_logit: u64,
) -> PyResult<()> {
    let stats = ForeignTileStats {
        row_max,
        row_sum,
        target_logit,
    };
    on_device(device, stream, tile, |backend, tile| {
        // SAFETY: `headroom.torch` passes the data pointers of live dense CUDA tensors of this
        // device that it holds past the launch in stream order (torch's caching allocator
        // reuses their memory only in stream order): the tile of `rows × width` elements of
        // `dtype`, `rows` labels (i64, `label_stride` apart) and three fresh vectors of `rows`
        // statistics; torch's default stream is the launch's (checked); null addresses are
        // refused by the callee.
        unsafe { backend.cross_entropy_tile_at(tile, &stats) }
    })
}

/// Overwrites the tile with `scale · (softmax − onehot)` from each row's log-sum-exp `lse` and
/// gradient share `scale` (vectors of `rows` in the statistics dtype).
#[pyfunction]
#[pyo3(signature = (device, stream, tile, lse, scale))]
fn cross_entropy_tile_backward(
    device: usize,
    stream: u64,
    tile: TileArgs,
    lse: u64,
    scale: u64,
) -> PyResult<()> {
    let gradient = ForeignTileGradient { lse, scale };
    on_device(device, stream, tile, |backend, tile| {
        // SAFETY: as in `cross_entropy_tile`: live dense CUDA tensors of this device held past
        // the launch in stream order — the recomputed tile (written in place), the labels, and
        // `rows` values each of `lse` and `scale`, which do not overlap the tile; default
        // stream checked.
        unsafe { backend.cross_entropy_tile_backward_at(tile, &gradient) }
    })
}
