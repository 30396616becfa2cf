//! Fused attention on tensor cores (FlashAttention-2 style, the kernel bodies of
//! `kernels/attention_flash.cuh`): forward, and backward as a dQ kernel (which also writes each
//! query's `Δ = dO·O`) followed by a dK/dV kernel. Two families share them:
//!
//! - f16 and bf16 (`kernels/attention_tc.cu`): `mma.sync.m16n8k16` on the storage dtype;
//! - f32 (`kernels/attention_tf32.cu`): f32 accuracy from split TF32 operands (each product as
//!   three TF32 products of the operands' TF32 parts and remainders, as PyTorch's
//!   memory-efficient kernel computes f32).
//!
//! Same operands (`AttnArgs` of `args.rs`: strided `[batch, heads, rows, head_dim]` views read in
//! place) and same saved state (one f32 log-sum-exp per query) as the other attention paths. The
//! kernels move 16-byte chunks, so they take head dims that are multiples of a chunk (8 elements
//! in 16 bits, 4 in f32) up to 128 with every operand chunk-aligned ([`fits`]); the family's entry
//! point (`mod.rs`) sends other 16-bit operands to the cuBLAS path of `gemm.rs` and other f32 ones
//! to the register-tiled kernels. Blocks of 128 threads take 64 rows of one (batch, head) pair (the
//! 16-bit forward at head dims up to 64: 128, 32 a warp) and
//! stream the other side 64 rows at a time (f32 at head dims up to 64: 32 below 512 rows, where
//! twice the blocks fit an SM); the head dim is padded to 32, 64, 96 or 128 in shared memory. Grouped-query heads and
//! packed sequences travel in `AttnArgs`: the dK/dV grid runs over (batch, key/value head) pairs,
//! each block summing its group's query heads in registers. `Δ` lives in scratch from the caching
//! allocator for the duration of the backward.
//!
//! This path sits on the attention family's `args.rs` and the ground floor, and imports no other
//! path.

use cudarc::driver::LaunchConfig;
use headroom_autograd_core::{
    AttentionBackward, AttentionDims, AttentionForward, DType, Result, TensorError, View,
};

use super::args::{address, attn_args, with_tiles_heaviest_first, AttnArgs, TileShape};
use crate::device::CudaBackend;
use crate::kernels::Module;
use crate::launch::{launch_in, Param};
use crate::operands::element_address;
use crate::scratch::Scratch;

/// Threads per block.
const THREADS: u32 = 128;
/// Own rows per block (`R` in the kernels) where a warp holds 16 of them.
const ROWS: usize = 64;

/// The 16-bit kernels at head dims up to 64, in the order of [`Kernel`] (`attention_tc.cu`'s
/// `TC_NARROW` says the same): the forward holds 32 queries a warp, so each key or value fragment
/// read from shared memory feeds two products. The other shapes `attention_tc.cu` names (32
/// queries a warp in the dQ kernel, 32 streamed rows in any kernel) ran slower on the H200.
const TC_NARROW_SHAPES: [TileShape; 3] = [
    TileShape {
        rows: 128,
        streamed: 64,
    },
    TileShape {
        rows: 64,
        streamed: 64,
    },
    TileShape {
        rows: 64,
        streamed: 64,
    },
];
/// Bytes each thread moves at once: operands are aligned to this many bytes' worth of elements.
const CHUNK_BYTES: usize = 16;
/// Largest head dim the kernels take.
const MAX_HEAD_DIM: usize = 128;
/// Most (batch, head) pairs of one launch (the grid's y extent).
const MAX_PAIRS: usize = 65_535;

/// Whether the tensor-core kernels take these dims and operands (`[batch, heads, rows,
/// head_dim]` views of f16, bf16 or f32): head dim a multiple of a 16-byte chunk up to 128, every
/// operand's offset and strides multiples of a chunk with a contiguous head dim, buffers 16-byte
/// aligned.
pub(crate) fn fits(dims: &AttentionDims, views: &[View<'_>]) -> bool {
    let chunk = CHUNK_BYTES / views[0].dtype.size_in_bytes();
    dims.head_dim.is_multiple_of(chunk)
        && dims.head_dim <= MAX_HEAD_DIM
        && dims.batch * dims.heads <= MAX_PAIRS
        && views.iter().all(|view| {
            let strides = view.layout.strides();
            view.layout.offset().is_multiple_of(chunk)
                && strides.len() == 4
                && strides[3] == 1
                && strides[..3].iter().all(|s| s.is_multiple_of(chunk))
                && view.buffer.address().is_multiple_of(CHUNK_BYTES as u64)
        })
}

/// Rows of each streamed f32 tile (`KR` in the kernels) when the other side has `streamed_rows`:
/// 64 from 512 rows on (and at head dims over 64), 32 below. Measured on the H200 (results/2026-12-04-6db5250): 64 is faster
/// at GPT-2's 1024 tokens (forward + backward 1.590 against 1.694 ms at batch 8) and Llama's 2048
/// and 4096; 32 at ViT's 197 (0.827 against 0.917 ms at batch 32), where twice the blocks fit an
/// SM.
fn f32_streamed_tile_rows(padded: usize, streamed_rows: usize) -> usize {
    if streamed_rows >= 512 || padded > 64 {
        64
    } else {
        32
    }
}

/// The three kernels of a family, in the order of [`Kernel`].
const TC_KERNELS: [&str; 3] = [
    "attention_tc_forward",
    "attention_tc_backward_dq",
    "attention_tc_backward_dkdv",
];
const TF32_KERNELS: [&str; 3] = [
    "attention_tf32_forward",
    "attention_tf32_backward_dq",
    "attention_tf32_backward_dkdv",
];
/// The same built with dropout (`attention_flash.cuh`'s `DROP`), bf16 at padded head dims 64
/// and 128 only (f32 with dropout takes the register-tiled kernels; f16 has none).
const TC_DROPOUT_KERNELS: [&str; 3] = [
    "attention_tc_forward_dropout",
    "attention_tc_backward_dq_dropout",
    "attention_tc_backward_dkdv_dropout",
];

/// One of a family's kernels.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    Forward = 0,
    BackwardDq = 1,
    BackwardDkDv = 2,
}

/// One family's kernels for one launch shape: their module, names and suffix, element and
/// shared-row sizes and streamed rows.
struct Variant {
    module: Module,
    /// The kernels are `<names[kernel]>_<suffix>`.
    names: &'static [&'static str; 3],
    suffix: &'static str,
    element_bytes: usize,
    /// Elements of one shared row: the padded head dim and its pad.
    row: usize,
    /// Each kernel's tiles, in the order of [`Kernel`].
    shapes: [TileShape; 3],
}

impl Variant {
    /// The kernels for `dtype` and `head_dim` with a streamed side of `streamed_rows`, built
    /// with dropout when `dropout` (16-bit only; the head dim padded to 64 or 128).
    fn new(dtype: DType, head_dim: usize, streamed_rows: usize, dropout: bool) -> Result<Variant> {
        let padded = match head_dim.div_ceil(32).max(1) * 32 {
            padded if dropout && padded <= 64 => 64,
            _ if dropout => 128,
            padded => padded,
        };
        let uniform = |streamed| {
            [TileShape {
                rows: ROWS,
                streamed,
            }; 3]
        };
        let tc_names = if dropout {
            &TC_DROPOUT_KERNELS
        } else {
            &TC_KERNELS
        };
        let (module, names, pad, shapes) = match dtype {
            DType::F32 | DType::F16 if dropout => {
                return Err(TensorError::InvalidArgument {
                    op: "attention",
                    reason: format!("no {dtype:?} tensor-core attention kernel with dropout"),
                })
            }
            DType::F32 => (
                Module::AttentionTf32,
                &TF32_KERNELS,
                4,
                uniform(f32_streamed_tile_rows(padded, streamed_rows)),
            ),
            _ if padded <= 64 => (Module::AttentionTc, tc_names, 8, TC_NARROW_SHAPES),
            _ => (Module::AttentionTc, tc_names, 8, uniform(ROWS)),
        };
        let streamed = shapes[0].streamed;
        let suffix = match (dtype, padded, streamed) {
            (DType::BF16, 32, _) => "bf16_32",
            (DType::BF16, 64, _) => "bf16_64",
            (DType::BF16, 96, _) => "bf16_96",
            (DType::BF16, 128, _) => "bf16_128",
            (DType::F16, 32, _) => "f16_32",
            (DType::F16, 64, _) => "f16_64",
            (DType::F16, 96, _) => "f16_96",
            (DType::F16, 128, _) => "f16_128",
            (DType::F32, 32, 32) => "32_32",
            (DType::F32, 64, 32) => "64_32",
            (DType::F32, 32, _) => "32_64",
            (DType::F32, 64, _) => "64_64",
            (DType::F32, 96, _) => "96_64",
            (DType::F32, 128, _) => "128_64",
            (dtype, _, _) => {
                return Err(TensorError::InvalidArgument {
                    op: "attention",
                    reason: format!(
                        "no tensor-core attention kernel for {dtype:?} head dim {head_dim}"
                    ),
                })
            }
        };
        Ok(Variant {
            module,
            names,
            suffix,
            element_bytes: dtype.size_in_bytes(),
            row: padded + pad,
            shapes,
        })
    }

    /// The launch shape of `kernel` over `rows` rows of each of `pairs` (batch, head) pairs (query
    /// heads, or key/value heads for dK/dV), with shared memory for `tiles` rows of elements and
    /// `stats` f32 values.
    fn config(
        &self,
        kernel: Kernel,
        pairs: usize,
        rows: usize,
        tiles: usize,
        stats: usize,
    ) -> LaunchConfig {
        let bytes = tiles * self.row * self.element_bytes + stats * 4;
        LaunchConfig {
            // `fits` bounds the pairs by 65 535; rows are u32 (checked by `attn_args`).
            grid_dim: (
                rows.div_ceil(self.shapes[kernel as usize].rows) as u32,
                pairs as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: bytes as u32,
        }
    }

    fn launch(
        &self,
        backend: &CudaBackend,
        op: &'static str,
        kernel: Kernel,
        config: LaunchConfig,
        params: &[Param],
        args: AttnArgs,
    ) -> Result<()> {
        launch_in(
            backend,
            self.module,
            op,
            (self.names[kernel as usize], self.suffix),
            config,
            params,
            Some(args),
        )
    }
}

/// `args` with `kernel`'s tiles heaviest first when the attention is packed, and the device
/// scratch holding the order (`args.rs`' `with_tiles_heaviest_first`).
fn with_packed_order<'b>(
    backend: &'b CudaBackend,
    args: AttnArgs,
    f: &AttentionForward<'_>,
    variant: &Variant,
    kernel: Kernel,
    rows: usize,
) -> Result<(AttnArgs, Option<Scratch<'b>>)> {
    let own_queries = !matches!(kernel, Kernel::BackwardDkDv);
    let shape = variant.shapes[kernel as usize];
    with_tiles_heaviest_first(backend, args, f, own_queries, rows, shape)
}

/// The log-sum-exp's first element (dense f32 `[batch, heads, queries]`).
fn lse_address(f: &AttentionForward<'_>) -> Param {
    Param::U64(element_address(&f.lse))
}

/// Forward; the caller checked [`fits`] for q, k, v and out.
pub(crate) fn forward(
    backend: &CudaBackend,
    f: AttentionForward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let variant = Variant::new(f.q.dtype, dims.head_dim, dims.keys, f.dropout.is_some())?;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out])?;
    // Q, and two buffers each of K and V.
    let shape = variant.shapes[Kernel::Forward as usize];
    let tiles = shape.rows + 4 * shape.streamed;
    let pairs = dims.batch * dims.heads;
    let config = variant.config(Kernel::Forward, pairs, dims.queries, tiles, 0);
    let (args, _order) =
        with_packed_order(backend, args, &f, &variant, Kernel::Forward, dims.queries)?;
    let params = [
        address(&f.q),
        address(&f.k),
        address(&f.v),
        address(&f.out),
        lse_address(&f),
    ];
    variant.launch(backend, "attention", Kernel::Forward, config, &params, args)
}

/// Backward; the caller checked [`fits`] for q, k, v, out, dout, dq, dk and dv.
pub(crate) fn backward(
    backend: &CudaBackend,
    b: AttentionBackward<'_>,
    dims: AttentionDims,
) -> Result<()> {
    let f = b.forward;
    let args = attn_args(&dims, &f, &[f.q, f.k, f.v, f.out, b.dout, b.dq, b.dk, b.dv])?;
    // Δ per query, from the caching allocator, returned (in stream order) after the launches.
    let delta = Scratch::new(backend, (dims.batch * dims.heads * dims.queries * 4) as u64)?;
    let delta_address = Param::U64(delta.address());
    // Each kernel's shared memory holds two tiles of own rows (Q and dO, or K and V) and two
    // buffers each of the streamed two (the dQ kernel streams keys, the dK/dV kernel queries).
    let variant = Variant::new(
        f.q.dtype,
        dims.head_dim,
        dims.keys.min(dims.queries),
        f.dropout.is_some(),
    )?;
    let tiles = |kernel: Kernel| {
        let shape = variant.shapes[kernel as usize];
        2 * shape.rows + 4 * shape.streamed
    };
    if dims.queries > 0 {
        // With the log-sum-exp and Δ of the block's queries.
        let rows = variant.shapes[Kernel::BackwardDq as usize].rows;
        let config = variant.config(
            Kernel::BackwardDq,
            dims.batch * dims.heads,
            dims.queries,
            tiles(Kernel::BackwardDq),
            2 * rows,
        );
        let params = [
            address(&f.q),
            address(&f.k),
            address(&f.v),
            address(&f.out),
            address(&b.dout),
            lse_address(&f),
            address(&b.dq),
            delta_address,
        ];
        let (args, _order) = with_packed_order(
            backend,
            args,
            &f,
            &variant,
            Kernel::BackwardDq,
            dims.queries,
        )?;
        variant.launch(
            backend,
            "attention_backward",
            Kernel::BackwardDq,
            config,
            &params,
            args,
        )?;
    }
    if dims.keys > 0 {
        // With both query buffers' statistics. One block per (batch, key/value head) and its own
        // keys, over the group's query heads.
        let stats = 4 * variant.shapes[Kernel::BackwardDkDv as usize].streamed;
        let config = variant.config(
            Kernel::BackwardDkDv,
            dims.batch * dims.kv_heads,
            dims.keys,
            tiles(Kernel::BackwardDkDv),
            stats,
        );
        let params = [
            address(&f.q),
            address(&f.k),
            address(&f.v),
            address(&b.dout),
            lse_address(&f),
            delta_address,
            address(&b.dk),
            address(&b.dv),
        ];
        let (args, _order) =
            with_packed_order(backend, args, &f, &variant, Kernel::BackwardDkDv, dims.keys)?;
        variant.launch(
            backend,
            "attention_backward",
            Kernel::BackwardDkDv,
            config,
            &params,
            args,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel a launch can name is an entry of its module's PTX: each dtype, padded head
    /// dim and streamed tile height.
    #[test]
    fn every_variant_names_kernels_of_its_module() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for head_dim in [8, 32, 40, 64, 72, 96, 104, 128] {
                let dropouts: &[bool] = if dtype == DType::BF16 {
                    &[false, true]
                } else {
                    &[false]
                };
                for (streamed_rows, &dropout) in [100, 2048]
                    .into_iter()
                    .flat_map(|rows| dropouts.iter().map(move |dropout| (rows, dropout)))
                {
                    let variant = Variant::new(dtype, head_dim, streamed_rows, dropout).unwrap();
                    let ptx = variant.module.ptx();
                    for name in variant.names {
                        let entry = format!(".entry {name}_{}(", variant.suffix);
                        assert!(ptx.contains(&entry), "{dtype:?} d{head_dim}: no {entry}");
                    }
                }
            }
        }
        assert!(Variant::new(DType::F32, 160, 100, false).is_err());
    }

    /// The host's tile shapes for the 16-bit kernels at head dims up to 64 are the ones
    /// `attention_tc.cu`'s `TC_NARROW` builds (the forward's and dQ's 64·MW queries and KR keys,
    /// dK/dV's 64 keys and KR queries): a launch with other shapes would read past its tiles.
    #[test]
    fn narrow_tile_shapes_match_the_kernels() {
        let source = include_str!("../../kernels/attention_tc.cu");
        let line = source
            .lines()
            .find(|line| line.starts_with("#define TC_NARROW("))
            .expect("attention_tc.cu defines TC_NARROW");
        let inner = &line[line.rfind('(').unwrap() + 1..line.rfind(')').unwrap()];
        let numbers: Vec<usize> = inner
            .split(',')
            .skip(4)
            .map(|field| field.trim().parse().unwrap())
            .collect();
        let [forward_mw, forward_kr, dq_mw, dq_kr, dkdv_kr, _min_blocks] = numbers[..] else {
            panic!("TC_NARROW passes six numbers: {line}");
        };
        let shape = |mw: usize, streamed| TileShape {
            rows: 64 * mw,
            streamed,
        };
        assert_eq!(
            TC_NARROW_SHAPES,
            [
                shape(forward_mw, forward_kr),
                shape(dq_mw, dq_kr),
                shape(1, dkdv_kr)
            ]
        );
    }
}
