//! The Llama attention cases of the kernels bench (issue 30): causal bf16 grouped-query attention
//! at batch 4, 32 query heads, 8 key/value heads, 2048 tokens, head dim 64 (forward, backward and
//! both), and 16 packed sequences against the same work as one dense sequence.
//!
//! FLOP convention (the one `scripts/pytorch/attention_reference.py` prints for PyTorch's SDPA):
//! the causal half only, forward `4 · b · h · s² · d / 2` (two products of `s²/2` scores), backward
//! 2.5× that (five products against the forward's two), so "fwd+bwd" is 3.5× the forward's. For
//! packed sequences `s²` is `Σ len²`.
//!
//! Packed: 16 lengths drawn from 64..=2048 (fixed seed), laid end to end and run as one call with
//! `cu_seqlens`. The target's reference, "the same tokens as one sequence's worth of work", is one
//! dense causal sequence doing the same FLOPs (`s = √Σ len²`, rounded to 64); the 16 sequences
//! run one call each are timed too, for context. The table's TFLOP/s of the packed and the
//! equal-work cases give the ratio (target: packed time ≤ 1.05× the equal-work time).

use headroom_autograd_core::{
    AttentionBackward, AttentionForward, BackendRef, DType, Layout, PackedBounds, PackedSequences,
    Tensor, View,
};
use headroom_ops_cuda::CudaStream;
use headroom_testkit::inputs::Xorshift;

use super::{Bench, Work};

const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 64;

/// Buffers of one `[batch, seq]` problem: q, k, v, out, dout and the gradients, laid out as nn's
/// Llama attention passes them (`[batch, seq, heads · head_dim]` projections viewed as heads).
struct Problem {
    batch: usize,
    seq: usize,
    q: Tensor,
    kv: [Tensor; 2],
    out: Tensor,
    dout: Tensor,
    grads: [Tensor; 3],
    lse: Tensor,
}

impl Problem {
    fn new(bench: &Bench, batch: usize, seq: usize) -> Problem {
        let (width, kv_width) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        let bf16 = DType::BF16;
        Problem {
            batch,
            seq,
            q: bench.tensor(&[batch, seq, width], bf16, 31),
            kv: [32, 33].map(|seed| bench.tensor(&[batch, seq, kv_width], bf16, seed)),
            out: bench.empty(&[batch, seq, width], bf16),
            dout: bench.tensor(&[batch, seq, width], bf16, 34),
            grads: [width, kv_width, kv_width].map(|w| bench.empty(&[batch, seq, w], bf16)),
            lse: bench.empty(&[batch, HEADS, seq], DType::F32),
        }
    }

    /// Heads views of `heads` heads over rows `first..first + len` of every batch row.
    fn heads(&self, heads: usize, first: usize, len: usize) -> Layout {
        let width = heads * HEAD_DIM;
        Layout::from_parts(
            &[self.batch, heads, len, HEAD_DIM],
            &[self.seq * width, HEAD_DIM, width, 1],
            first * width,
        )
        .expect("layout")
    }

    /// Forward and backward over rows `first..first + len` (all of them, with `packed`); the
    /// forward alone when `backward` is false.
    fn run(&self, gpu: &BackendRef, first: usize, len: usize, packed: Option<PackedBounds<'_>>) {
        self.pass(gpu, first, len, packed, true);
    }

    fn pass(
        &self,
        gpu: &BackendRef,
        first: usize,
        len: usize,
        packed: Option<PackedBounds<'_>>,
        backward: bool,
    ) {
        let (q_layout, kv_layout) = (
            self.heads(HEADS, first, len),
            self.heads(KV_HEADS, first, len),
        );
        // The log-sum-exp is dense (the kernels' rule): one sequence's at the buffer's start.
        let lse_layout = Layout::contiguous(&[self.batch, HEADS, len]);
        fn view<'a>(t: &'a Tensor, layout: &'a Layout) -> View<'a> {
            View {
                buffer: t.buffer(),
                layout,
                dtype: t.dtype(),
            }
        }
        let forward = AttentionForward {
            q: view(&self.q, &q_layout),
            k: view(&self.kv[0], &kv_layout),
            v: view(&self.kv[1], &kv_layout),
            scale: 1.0 / (HEAD_DIM as f64).sqrt(),
            causal: true,
            packed,
            dropout: None,
            out: view(&self.out, &q_layout),
            lse: view(&self.lse, &lse_layout),
        };
        gpu.attention(forward).expect("attention");
        if !backward {
            return;
        }
        gpu.attention_backward(AttentionBackward {
            forward,
            dout: view(&self.dout, &q_layout),
            dq: view(&self.grads[0], &q_layout),
            dk: view(&self.grads[1], &kv_layout),
            dv: view(&self.grads[2], &kv_layout),
        })
        .expect("attention backward");
    }
}

/// Causal FLOPs of one forward over `Σ len²` score entries (the causal half counted).
fn forward_flops(batch: usize, squares: usize) -> u64 {
    (4 * batch * HEADS * squares * HEAD_DIM / 2) as u64
}

/// The target shape, then the packed case.
pub(crate) fn llama_attention(bench: &mut Bench, compute: &CudaStream) {
    let gpu = bench.gpu.clone();
    let (batch, seq) = (4, 2048);
    let target = Problem::new(bench, batch, seq);
    let flops = forward_flops(batch, seq * seq);
    // Bytes of one pass: q, k, v and out (backward: also dout and the three gradients).
    let io = ((2 * HEADS + 2 * KV_HEADS) * batch * seq * HEAD_DIM * 2) as u64;
    bench.case(
        "llama_attention",
        "bf16_causal_fwd_bwd_b4_h32_kv8_s2048_d64",
        Work {
            bytes: 3 * io,
            flops: flops * 7 / 2,
        },
        compute,
        || target.run(&gpu, 0, seq, None),
    );
    // The forward alone on the default kernels (the case above: the mma.sync kernels, on compute
    // capability 9.0 the warp-specialised forward and backward); then forward and forward
    // + backward on the mma.sync kernels and (compute capability 9.0) on the wgmma ones and the
    // warp-specialised kernels' builds (`HEADROOM_ATTENTION_WGMMA` 0, 1, ws, ws-overlap and
    // ws-pingpong, read at each call).
    for (engine, hopper) in [
        ("", None),
        ("_mma", Some("0")),
        ("_wgmma", Some("1")),
        ("_ws", Some("ws")),
        ("_ws_overlap", Some("ws-overlap")),
        ("_ws_pingpong", Some("ws-pingpong")),
    ] {
        super::attention_engine(hopper);
        bench.case(
            "llama_attention",
            &format!("bf16_causal_forward{engine}_b4_h32_kv8_s2048_d64"),
            Work { bytes: io, flops },
            compute,
            || target.pass(&gpu, 0, seq, None, false),
        );
        if hopper.is_some() {
            bench.case(
                "llama_attention",
                &format!("bf16_causal_fwd_bwd{engine}_b4_h32_kv8_s2048_d64"),
                Work {
                    bytes: 3 * io,
                    flops: flops * 7 / 2,
                },
                compute,
                || target.run(&gpu, 0, seq, None),
            );
        }
    }
    super::attention_engine(None);
    drop(target);

    let mut random = Xorshift::from_state(0x0001_1a3a_0030);
    let lengths: Vec<usize> = (0..16)
        .map(|_| 64 + random.next_below(2048 - 64 + 1) as usize)
        .collect();
    let tokens: usize = lengths.iter().sum();
    let squares: usize = lengths.iter().map(|len| len * len).sum();
    println!("llama_attention packed: lengths {lengths:?}, {tokens} tokens, Σ len² = {squares}");
    let packed = PackedSequences::from_lengths(&gpu, &lengths).expect("cu_seqlens");
    let problem = Problem::new(bench, 1, tokens);
    let work = Work {
        bytes: 3 * ((2 * HEADS + 2 * KV_HEADS) * tokens * HEAD_DIM * 2) as u64,
        flops: forward_flops(1, squares) * 7 / 2,
    };
    let bounds = PackedBounds {
        cu_seqlens: packed.device().view(),
        host: packed.cu_seqlens(),
    };
    bench.case(
        "llama_attention",
        "bf16_packed_16_seqs_fwd_bwd",
        work,
        compute,
        || problem.run(&gpu, 0, tokens, Some(bounds)),
    );
    bench.case(
        "llama_attention",
        "bf16_16_seqs_one_call_each_fwd_bwd",
        work,
        compute,
        || {
            for window in packed.cu_seqlens().windows(2) {
                let (first, len) = (window[0] as usize, (window[1] - window[0]) as usize);
                problem.run(&gpu, first, len, None);
            }
        },
    );
    drop(problem);
    // One dense sequence doing the same FLOPs: the target's reference.
    let equal = ((squares as f64).sqrt() / 64.0).round() as usize * 64;
    let dense = Problem::new(bench, 1, equal);
    bench.case(
        "llama_attention",
        &format!("bf16_equal_work_one_seq_s{equal}_fwd_bwd"),
        Work {
            bytes: 3 * ((2 * HEADS + 2 * KV_HEADS) * equal * HEAD_DIM * 2) as u64,
            flops: forward_flops(1, equal * equal) * 7 / 2,
        },
        compute,
        || dense.run(&gpu, 0, equal, None),
    );
}
