//! One criterion group per kernel family of the CUDA backend, called through the `Backend` trait
//! on ViT-L/16 batch-32 shapes (`[32·197, 1024]` and `[32·197, 4096]` activations,
//! `[32, 16, 197, 197]` attention scores), plus GEMM, fused attention (forward and backward, heads
//! strided out of a packed q/k/v projection as ViT passes them) and host↔device copies from pinned
//! and pageable memory; the Llama cases are `kernels/llama.rs`'s (RMSNorm, SwiGLU, rotary
//! embedding on Llama-3.2-1B shapes) and `kernels/llama_attention.rs`'s (causal bf16 grouped-query
//! attention at issue 30's target shape and packed sequences, in TFLOP/s of the causal half), and
//! on a compute capability 9.0 device `kernels/hopper_attention.rs`'s (issue 35's target shapes on
//! every attention engine).
//!
//! Each case declares the bytes an ideal pass moves (every input read once, every output written
//! once), so criterion prints GB/s; GEMMs declare FLOPs as elements (criterion's `elem/s` is
//! FLOP/s). Every iteration synchronizes, and timing events around each launch give the device
//! time as well. After criterion, a table lists each case's device-time GB/s against the copy
//! ceiling measured in the same run (a 2 GB device-to-device `cuMemcpyDtoDAsync`, read + write
//! bytes, as PyTorch's reference measures its 4.26 TB/s) and GEMM TFLOP/s.
//!
//! `cargo bench -p headroom-ops-cuda --features cuda --bench kernels` (or the binary with
//! `--bench`); without a device it prints a skip notice.

#[path = "kernels/hopper_attention.rs"]
mod hopper_attention;
#[path = "kernels/llama_attention.rs"]
mod llama_attention;
#[path = "kernels/vit_attention.rs"]
mod vit_attention;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use headroom_autograd_core::{
    BackendRef, BinaryOp, CrossEntropyArgs, CrossEntropyBackward, CrossEntropyForward, DType,
    DropoutDraw, LayerNormBackward, LayerNormForward, Layout, ReduceOp, Reduction, SoftmaxBackward,
    Tensor, UnaryOp, View,
};
use headroom_ops_cuda::{CudaBackend, CudaStream};
use headroom_testkit::gpu::cuda_or_skip;
use headroom_testkit::inputs::uniform_f32;

#[path = "kernels/llama.rs"]
mod llama;

/// Tokens of a ViT-L/16 batch of 32 (196 patches and the class token).
const ROWS: usize = 32 * 197;
const HIDDEN: usize = 1024;
const MLP: usize = 4096;
/// Batch × heads of the attention scores, and their sequence and head sizes.
const HEADS: usize = 32 * 16;
const SEQ: usize = 197;
const HEAD_DIM: usize = 64;
const SAMPLES: usize = 10;
/// The reference ceiling of PyTorch's run (anchors.md), printed beside the one measured here.
const REFERENCE_CEILING_GBPS: f64 = 4260.0;

/// What one pass of a case does: bytes moved, and floating-point operations for GEMMs.
#[derive(Clone, Copy)]
struct Work {
    bytes: u64,
    flops: u64,
}

impl Work {
    fn bytes(bytes: usize) -> Work {
        Work {
            bytes: bytes as u64,
            flops: 0,
        }
    }
}

/// One measured case: medians over criterion's samples of the per-iteration times.
struct Case {
    family: &'static str,
    name: String,
    work: Work,
    device_ms: f64,
    host_ms: f64,
}

struct Bench {
    criterion: Criterion,
    cuda: Arc<CudaBackend>,
    gpu: BackendRef,
    compute: CudaStream,
    cases: Vec<Case>,
}

impl Bench {
    /// Runs `op` under criterion as `family/name`, timing each iteration with events on
    /// `stream` and synchronizing after it.
    fn case(
        &mut self,
        family: &'static str,
        name: &str,
        work: Work,
        stream: &CudaStream,
        mut op: impl FnMut(),
    ) {
        let start = stream.record_timing_event().expect("event");
        let end = stream.record_timing_event().expect("event");
        let mut samples: Vec<(f64, f64)> = Vec::new();
        let mut group = self.criterion.benchmark_group(family);
        group.throughput(if work.flops > 0 {
            Throughput::Elements(work.flops)
        } else {
            Throughput::Bytes(work.bytes)
        });
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut device_ms = 0.0;
                let host_start = Instant::now();
                for _ in 0..iters {
                    start.record(stream).expect("record");
                    op();
                    end.record(stream).expect("record");
                    end.synchronize().expect("synchronize");
                    device_ms += f64::from(start.elapsed_ms(&end).expect("elapsed"));
                }
                let host = host_start.elapsed();
                let n = iters.max(1) as f64;
                samples.push((device_ms / n, host.as_secs_f64() * 1e3 / n));
                host
            })
        });
        group.finish();
        // The warm-up's calls come first; the last SAMPLES are criterion's samples.
        let measured = &samples[samples.len().saturating_sub(SAMPLES)..];
        let case = Case {
            family,
            name: name.to_string(),
            work,
            device_ms: median(measured.iter().map(|s| s.0)),
            host_ms: median(measured.iter().map(|s| s.1)),
        };
        // A line per case as it completes, so a run cut short still reports what it measured.
        eprintln!(
            "measured {family}/{name}: {:.1} µs device, {:.0} GB/s",
            case.device_ms * 1e3,
            gbps(work.bytes, case.device_ms)
        );
        self.cases.push(case);
    }

    fn tensor(&self, shape: &[usize], dtype: DType, seed: u64) -> Tensor {
        let n = shape.iter().product();
        let f32s = Tensor::from_slice(&self.gpu, &uniform_f32(n, seed), shape).expect("upload");
        if dtype == DType::F32 {
            return f32s;
        }
        let res = Tensor::empty(&self.gpu, shape, dtype).expect("alloc");
        self.gpu.copy(f32s.view(), res.view()).expect("cast");
        res
    }

    fn empty(&self, shape: &[usize], dtype: DType) -> Tensor {
        Tensor::empty(&self.gpu, shape, dtype).expect("alloc")
    }

    fn indices(&self, n: usize, bound: usize, seed: u64) -> Tensor {
        let values: Vec<i64> = uniform_f32(n, seed)
            .iter()
            .map(|v| (((v + 1.0) / 2.0) * bound as f32) as i64 % bound as i64)
            .collect();
        Tensor::from_slice(&self.gpu, &values, &[n]).expect("upload")
    }
}

/// Sends the 16-bit attention calls that follow to the engine `HEADROOM_ATTENTION_WGMMA` names
/// (`0` the mma.sync kernels, `1`, `ws`, `ws-overlap`, `ws-pingpong`; read at each call), or to
/// the default for `None` (on compute capability 9.0 the warp-specialised forward and wgmma's
/// backward).
fn attention_engine(value: Option<&str>) {
    // SAFETY: the bench runs its cases on this one thread; nothing else reads the environment
    // meanwhile.
    unsafe {
        match value {
            Some(value) => std::env::set_var("HEADROOM_ATTENTION_WGMMA", value),
            None => std::env::remove_var("HEADROOM_ATTENTION_WGMMA"),
        }
    }
}

fn main() {
    let Some(cuda) = cuda_or_skip(CudaBackend::new(0)) else {
        return;
    };
    let criterion = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(150))
        .measurement_time(Duration::from_millis(400))
        .without_plots()
        .configure_from_args();
    let mut bench = Bench {
        criterion,
        gpu: cuda.clone(),
        compute: cuda.compute_stream(),
        cuda,
        cases: Vec::new(),
    };
    let compute = bench.compute.clone();

    ceiling_and_copies(&mut bench, &compute);
    elementwise(&mut bench, &compute);
    reductions(&mut bench, &compute);
    rows(&mut bench, &compute);
    indexing(&mut bench, &compute);
    gemm(&mut bench, &compute);
    vit_attention::attention(&mut bench, &compute);
    llama_attention::llama_attention(&mut bench, &compute);
    if bench.cuda.compute_capability() == (9, 0) {
        hopper_attention::hopper_attention(&mut bench, &compute);
    }
    llama::llama(&mut bench, &compute);
    host_copies(&mut bench);

    bench.criterion.final_summary();
    print_table(&bench);
}

/// The copy ceiling (driver memcpy, 2 GB), the copy kernel on the same bytes, and f32 → bf16.
fn ceiling_and_copies(bench: &mut Bench, compute: &CudaStream) {
    let n = 2_000_000_000 / 4;
    // The bytes do not change a copy's speed; a constant saves generating 2 GB on the host.
    let src = Tensor::full(&bench.gpu, &[n], 1.5, DType::F32).expect("alloc");
    let dst = bench.empty(&[n], DType::F32);
    let (src_address, dst_address) = (src.buffer().address(), dst.buffer().address());
    bench.case(
        "copy",
        "d2d_memcpy_2GB",
        Work::bytes(2 * 4 * n),
        compute,
        || {
            // SAFETY: both ranges are live 2 GB device buffers of this backend; the copy runs on the
            // legacy default stream, where the buffers' kernels run.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst_address,
                    src_address,
                    4 * n,
                    cudarc::driver::result::stream::null(),
                )
            }
            .expect("memcpy")
        },
    );
    let gpu = bench.gpu.clone();
    // A dense copy through `Backend::copy` takes the driver's copy; a strided one (every other
    // element of 4 GB: the same bytes written, twice the span read) the copy kernel.
    bench.case(
        "copy",
        "copy_dense_f32_2GB",
        Work::bytes(2 * 4 * n),
        compute,
        || gpu.copy(src.view(), dst.view()).expect("copy"),
    );
    drop(src);
    let wide = Tensor::full(&bench.gpu, &[n, 2], 1.5, DType::F32).expect("alloc");
    let every_other = Layout::from_parts(&[n], &[2], 0).unwrap();
    let strided = View {
        buffer: wide.buffer(),
        layout: &every_other,
        dtype: DType::F32,
    };
    bench.case(
        "copy",
        "copy_kernel_strided_f32_2GB",
        Work::bytes(2 * 4 * n),
        compute,
        || gpu.copy(strided, dst.view()).expect("copy"),
    );
    drop((wide, dst));

    let x = bench.tensor(&[ROWS, MLP], DType::F32, 2);
    let y = bench.empty(&[ROWS, MLP], DType::BF16);
    let n = ROWS * MLP;
    bench.case(
        "copy",
        "cast_f32_bf16_6304x4096",
        Work::bytes(6 * n),
        compute,
        || gpu.copy(x.view(), y.view()).expect("cast"),
    );
}

/// GELU, and the bias add of a linear layer (a `[4096]` row broadcast over the rows).
fn elementwise(bench: &mut Bench, compute: &CudaStream) {
    let gpu = bench.gpu.clone();
    let n = ROWS * MLP;
    let x = bench.tensor(&[ROWS, MLP], DType::F32, 3);
    let out = bench.empty(&[ROWS, MLP], DType::F32);
    bench.case(
        "unary",
        "gelu_f32_6304x4096",
        Work::bytes(8 * n),
        compute,
        || {
            gpu.unary(UnaryOp::Gelu, x.view(), out.view())
                .expect("gelu")
        },
    );
    let x16 = bench.tensor(&[ROWS, MLP], DType::BF16, 3);
    let out16 = bench.empty(&[ROWS, MLP], DType::BF16);
    bench.case(
        "unary",
        "gelu_bf16_6304x4096",
        Work::bytes(4 * n),
        compute,
        || {
            gpu.unary(UnaryOp::Gelu, x16.view(), out16.view())
                .expect("gelu")
        },
    );
    let bias = bench.tensor(&[MLP], DType::F32, 4);
    let broadcast = Layout::from_parts(&[ROWS, MLP], &[0, 1], 0).unwrap();
    let bias_view = View {
        buffer: bias.buffer(),
        layout: &broadcast,
        dtype: DType::F32,
    };
    bench.case(
        "binary",
        "bias_add_f32_6304x4096",
        Work::bytes(8 * n + 4 * MLP),
        compute,
        || {
            gpu.binary(BinaryOp::Add, x.view(), bias_view, out.view())
                .expect("add")
        },
    );
}

/// Sums over each row (the last dim) and over the rows (a bias gradient: a transposed view).
fn reductions(bench: &mut Bench, compute: &CudaStream) {
    let gpu = bench.gpu.clone();
    let n = ROWS * MLP;
    let x = bench.tensor(&[ROWS, MLP], DType::F32, 5);
    let row_sums = bench.empty(&[ROWS], DType::F32);
    bench.case(
        "reduce",
        "sum_rows_f32_6304x4096",
        Work::bytes(4 * n + 4 * ROWS),
        compute,
        || {
            gpu.reduce(ReduceOp::Sum, x.view(), 1, row_sums.view())
                .expect("sum")
        },
    );
    let column_sums = bench.empty(&[MLP], DType::F32);
    let transposed = Layout::from_parts(&[MLP, ROWS], &[1, MLP], 0).unwrap();
    let columns = View {
        buffer: x.buffer(),
        layout: &transposed,
        dtype: DType::F32,
    };
    bench.case(
        "reduce",
        "sum_columns_f32_6304x4096",
        Work::bytes(4 * n + 4 * MLP),
        compute,
        || {
            gpu.reduce(ReduceOp::Sum, columns, 1, column_sums.view())
                .expect("column sum")
        },
    );
}

/// Softmax over attention scores, layer norm over the hidden size, cross-entropy.
fn rows(bench: &mut Bench, compute: &CudaStream) {
    let gpu = bench.gpu.clone();
    let scores = [32, 16, SEQ, SEQ];
    let n = scores.iter().product::<usize>();
    let x = bench.tensor(&scores, DType::F32, 6);
    let y = bench.empty(&scores, DType::F32);
    let dy = bench.tensor(&scores, DType::F32, 7);
    let dx = bench.empty(&scores, DType::F32);
    bench.case(
        "softmax",
        "fwd_f32_32x16x197x197",
        Work::bytes(8 * n),
        compute,
        || gpu.softmax(x.view(), 3, false, y.view()).expect("softmax"),
    );
    bench.case(
        "softmax",
        "bwd_f32_32x16x197x197",
        Work::bytes(12 * n),
        compute,
        || {
            gpu.softmax_backward(SoftmaxBackward {
                y: y.view(),
                dy: dy.view(),
                dim: 3,
                log: false,
                dx: dx.view(),
            })
            .expect("softmax backward")
        },
    );
    drop((x, y, dy, dx));

    let n = ROWS * HIDDEN;
    let x = bench.tensor(&[ROWS, HIDDEN], DType::F32, 8);
    let weight = bench.tensor(&[HIDDEN], DType::F32, 9);
    let bias = bench.tensor(&[HIDDEN], DType::F32, 10);
    let out = bench.empty(&[ROWS, HIDDEN], DType::F32);
    let mean = bench.empty(&[ROWS], DType::F32);
    let rstd = bench.empty(&[ROWS], DType::F32);
    bench.case(
        "layer_norm",
        "fwd_f32_6304x1024",
        Work::bytes(8 * n + 8 * HIDDEN + 8 * ROWS),
        compute,
        || {
            gpu.layer_norm(LayerNormForward {
                x: x.view(),
                weight: Some(weight.view()),
                bias: Some(bias.view()),
                eps: 1e-6,
                out: out.view(),
                mean: mean.view(),
                rstd: rstd.view(),
            })
            .expect("layer norm")
        },
    );
    let dy = bench.tensor(&[ROWS, HIDDEN], DType::F32, 11);
    let dx = bench.empty(&[ROWS, HIDDEN], DType::F32);
    let dweight = bench.empty(&[HIDDEN], DType::F32);
    let dbias = bench.empty(&[HIDDEN], DType::F32);
    bench.case(
        "layer_norm",
        "bwd_f32_6304x1024",
        Work::bytes(12 * n + 12 * HIDDEN + 8 * ROWS),
        compute,
        || {
            gpu.layer_norm_backward(LayerNormBackward {
                dy: dy.view(),
                x: x.view(),
                mean: mean.view(),
                rstd: rstd.view(),
                weight: Some(weight.view()),
                dx: Some(dx.view()),
                dweight: Some(dweight.view()),
                dbias: Some(dbias.view()),
            })
            .expect("layer norm backward")
        },
    );
    drop((x, out, dy, dx));

    // ViT-L's head (batch 32, 1000 classes: launch-bound) and a GPT-2 batch (4 × 1024 tokens,
    // 50257 classes: bandwidth-bound).
    for (name, rows, classes) in [("32x1000", 32, 1000), ("4096x50257", 4096, 50257)] {
        let n = rows * classes;
        let logits = bench.tensor(&[rows, classes], DType::F32, 12);
        let target = bench.indices(rows, classes, 13);
        let loss = bench.empty(&[], DType::F32);
        let lse = bench.empty(&[rows], DType::F32);
        let dloss = Tensor::scalar(&bench.gpu, 1.0, DType::F32).expect("scalar");
        let dlogits = bench.empty(&[rows, classes], DType::F32);
        let input = CrossEntropyArgs {
            logits: logits.view(),
            target: target.view(),
            ignore_index: -100,
            reduction: Reduction::Mean,
        };
        let forward = CrossEntropyForward {
            input,
            loss: loss.view(),
            lse: lse.view(),
        };
        let backward = CrossEntropyBackward {
            input,
            lse: lse.view(),
            dloss: dloss.view(),
            dlogits: dlogits.view(),
        };
        let fwd = format!("fwd_f32_{name}");
        let bwd = format!("bwd_f32_{name}");
        bench.case(
            "cross_entropy",
            &fwd,
            Work::bytes(4 * n + 12 * rows),
            compute,
            || gpu.cross_entropy(forward).expect("cross entropy"),
        );
        bench.case(
            "cross_entropy",
            &bwd,
            Work::bytes(8 * n + 12 * rows),
            compute,
            || {
                gpu.cross_entropy_backward(backward)
                    .expect("cross entropy backward")
            },
        );
    }
}

/// Embedding-like gather and scatter-add (rows of a 32768 × 1024 table at random token ids),
/// and dropout.
fn indexing(bench: &mut Bench, compute: &CudaStream) {
    let gpu = bench.gpu.clone();
    let vocab = 32768;
    let n = ROWS * HIDDEN;
    let table = bench.tensor(&[vocab, HIDDEN], DType::F32, 14);
    let ids = bench.indices(ROWS, vocab, 15);
    let expanded = Layout::from_parts(&[ROWS, HIDDEN], &[1, 0], 0).unwrap();
    let index = View {
        buffer: ids.buffer(),
        layout: &expanded,
        dtype: DType::I64,
    };
    let out = bench.empty(&[ROWS, HIDDEN], DType::F32);
    bench.case(
        "gather",
        "embedding_f32_6304x1024",
        Work::bytes(8 * n + 8 * ROWS),
        compute,
        || {
            gpu.gather(table.view(), 0, index, out.view())
                .expect("gather")
        },
    );
    bench.case(
        "scatter_add",
        "embedding_grad_f32_6304x1024",
        Work::bytes(12 * n + 8 * ROWS),
        compute,
        || {
            gpu.scatter_add(table.view(), 0, index, out.view())
                .expect("scatter add")
        },
    );
    drop((table, out));

    let n = ROWS * MLP;
    let x = bench.tensor(&[ROWS, MLP], DType::F32, 16);
    let out = bench.empty(&[ROWS, MLP], DType::F32);
    let mask = bench.empty(&[ROWS, MLP], DType::Bool);
    let mut offset = 0u64;
    bench.case(
        "dropout",
        "p0.1_f32_6304x4096",
        Work::bytes(9 * n),
        compute,
        || {
            offset += n as u64;
            let draw = DropoutDraw {
                p: 0.1,
                seed: 17,
                offset,
            };
            gpu.dropout(x.view(), draw, out.view(), mask.view())
                .expect("dropout")
        },
    );
}

/// The MLP's first GEMM and the two attention GEMMs, in f32 and bf16.
fn gemm(bench: &mut Bench, compute: &CudaStream) {
    let gpu = bench.gpu.clone();
    for dtype in [DType::F32, DType::BF16] {
        let size = dtype.size_in_bytes();
        let tag = if dtype == DType::F32 { "f32" } else { "bf16" };
        let a = bench.tensor(&[ROWS, HIDDEN], dtype, 18);
        let b = bench.tensor(&[HIDDEN, MLP], dtype, 19);
        let c = bench.empty(&[ROWS, MLP], dtype);
        let work = Work {
            bytes: ((ROWS * HIDDEN + HIDDEN * MLP + ROWS * MLP) * size) as u64,
            flops: (2 * ROWS * HIDDEN * MLP) as u64,
        };
        bench.case(
            "gemm",
            &format!("{tag}_6304x1024x4096"),
            work,
            compute,
            || {
                gpu.matmul(a.view(), b.view(), c.view(), false)
                    .expect("matmul")
            },
        );
        drop((a, b, c));

        let q = bench.tensor(&[HEADS, SEQ, HEAD_DIM], dtype, 20);
        let k = bench.tensor(&[HEADS, SEQ, HEAD_DIM], dtype, 21);
        let v = bench.tensor(&[HEADS, SEQ, HEAD_DIM], dtype, 22);
        let k_t =
            Layout::from_parts(&[HEADS, HEAD_DIM, SEQ], &[SEQ * HEAD_DIM, 1, HEAD_DIM], 0).unwrap();
        let keys = View {
            buffer: k.buffer(),
            layout: &k_t,
            dtype,
        };
        let scores = bench.empty(&[HEADS, SEQ, SEQ], dtype);
        let context = bench.empty(&[HEADS, SEQ, HEAD_DIM], dtype);
        let flops = (2 * HEADS * SEQ * SEQ * HEAD_DIM) as u64;
        let qk = Work {
            bytes: ((2 * HEADS * SEQ * HEAD_DIM + HEADS * SEQ * SEQ) * size) as u64,
            flops,
        };
        bench.case(
            "gemm",
            &format!("{tag}_attn_qk_512x197x197x64"),
            qk,
            compute,
            || {
                gpu.matmul(q.view(), keys, scores.view(), false)
                    .expect("q k^T")
            },
        );
        bench.case(
            "gemm",
            &format!("{tag}_attn_pv_512x197x64x197"),
            qk,
            compute,
            || {
                gpu.matmul(scores.view(), v.view(), context.view(), false)
                    .expect("p v")
            },
        );
    }
}

/// 256 MiB host↔device from pinned memory (asynchronous, on side streams) and from pageable
/// memory (the trait's synchronous `write_host` / `read_host`).
fn host_copies(bench: &mut Bench) {
    let gpu = bench.gpu.clone();
    let cuda = bench.cuda.clone();
    let bytes = 256 << 20;
    let device = bench.tensor(&[bytes / 4], DType::F32, 23);
    let mut pinned = cuda.pinned_host(bytes).expect("pinned");
    pinned
        .as_mut_slice::<f32>()
        .expect("slice")
        .copy_from_slice(&uniform_f32(bytes / 4, 24));
    let mut pinned_out = cuda.pinned_host(bytes).expect("pinned");
    let up = cuda.new_stream().expect("stream");
    let down = cuda.new_stream().expect("stream");
    // The upload's destination comes from its stream's pool, so the copy waits for nothing.
    let device_b = cuda
        .allocate_on_stream(&up, || bench.empty(&[bytes / 4], DType::F32))
        .expect("stream");
    let work = Work::bytes(bytes);

    bench.case("host_copy", "h2d_pinned_256MiB", work, &up, || {
        cuda.copy_to_tensor_async(&pinned, 0, &device_b, &up)
            .expect("h2d")
    });
    bench.case("host_copy", "d2h_pinned_256MiB", work, &down, || {
        cuda.copy_from_tensor_async(&device, &mut pinned_out, 0, &down)
            .expect("d2h")
    });
    bench.case(
        "host_copy",
        "h2d+d2h_pinned_two_streams_256MiB_each",
        Work::bytes(2 * bytes),
        &up,
        || {
            down.wait_stream(&up).expect("wait");
            cuda.copy_to_tensor_async(&pinned, 0, &device_b, &up)
                .expect("h2d");
            cuda.copy_from_tensor_async(&device, &mut pinned_out, 0, &down)
                .expect("d2h");
            up.wait_stream(&down).expect("wait");
        },
    );
    let pageable: Vec<u8> = pinned.as_slice::<u8>().expect("slice").to_vec();
    let mut pageable_out = vec![0u8; bytes];
    let compute = bench.compute.clone();
    bench.case("host_copy", "h2d_pageable_256MiB", work, &compute, || {
        gpu.write_host(device_b.buffer(), 0, &pageable)
            .expect("write_host")
    });
    bench.case("host_copy", "d2h_pageable_256MiB", work, &compute, || {
        gpu.read_host(device.buffer(), 0, &mut pageable_out)
            .expect("read_host")
    });
    let stats = cuda.pinned_allocator().memory_stats();
    println!(
        "pinned allocator: {} B reserved, {} B allocated at peak",
        stats.reserved_bytes.all.peak, stats.allocated_bytes.all.peak
    );
}

fn print_table(bench: &Bench) {
    let ceiling = bench
        .cases
        .iter()
        .find(|case| case.name == "d2d_memcpy_2GB")
        .map_or(REFERENCE_CEILING_GBPS, |case| {
            gbps(case.work.bytes, case.device_ms)
        });
    let device = bench
        .cuda
        .allocator()
        .with_storage(|storage| storage.device_name());
    println!();
    println!(
        "device: {device}; copy ceiling measured here: {ceiling:.0} GB/s (PyTorch's reference run: \
         {REFERENCE_CEILING_GBPS:.0} GB/s); medians of {SAMPLES} samples, every iteration synchronized"
    );
    println!(
        "{:<14} {:<40} {:>9} {:>10} {:>9} {:>7} {:>7} {:>10} {:>8}",
        "family", "case", "MB/pass", "device µs", "GB/s", "%ceil", "%4.26", "host µs", "TFLOP/s"
    );
    for case in &bench.cases {
        let rate = gbps(case.work.bytes, case.device_ms);
        let tflops = if case.work.flops > 0 {
            format!("{:.1}", case.work.flops as f64 / case.device_ms / 1e9)
        } else {
            "-".to_string()
        };
        println!(
            "{:<14} {:<40} {:>9.1} {:>10.1} {:>9.0} {:>6.1}% {:>6.1}% {:>10.1} {:>8}",
            case.family,
            case.name,
            case.work.bytes as f64 / 1e6,
            case.device_ms * 1e3,
            rate,
            100.0 * rate / ceiling,
            100.0 * rate / REFERENCE_CEILING_GBPS,
            case.host_ms * 1e3,
            tflops
        );
    }
}

/// GB/s for `bytes` in `ms` milliseconds.
fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / ms / 1e6
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut sorted: Vec<f64> = values.collect();
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    (sorted[(n - 1) / 2] + sorted[n / 2]) / 2.0
}
