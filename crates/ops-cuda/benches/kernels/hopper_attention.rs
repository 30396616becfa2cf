//! The Hopper attention cases of the kernels bench (issue 35's targets): bf16 attention at batch
//! 4, 16 heads, 4096 tokens, head dims 128 and 64, causal and not, forward and forward + backward,
//! on the mma.sync kernels (`HEADROOM_ATTENTION_WGMMA=0`), the wgmma ones (`1`), the default
//! (the variable unset: the warp-specialised forward and backward) and the warp-specialised
//! forward and backward (`ws`; `ws-overlap` with FlashAttention-3's intra-warpgroup overlap,
//! `ws-pingpong` with its ping-pong too; the same backward). Operands
//! are laid out as a layer passes them (`[batch, seq, heads · head_dim]` projections viewed as
//! heads), as `scripts/pytorch/attention_reference.py --shape issue35` lays out cuDNN's.
//!
//! FLOP convention (that script's): a causal forward counts half the scores,
//! `4 · b · h · s² · d / 2`, a full one all of them; backward 2.5× the forward, forward + backward
//! 3.5×.

use headroom_autograd_core::{
    AttentionBackward, AttentionForward, BackendRef, DType, Layout, Tensor, View,
};
use headroom_ops_cuda::CudaStream;

use super::{Bench, Work};

const BATCH: usize = 4;
const HEADS: usize = 16;
const SEQ: usize = 4096;

/// q, k, v, out, dout, the gradients and the log-sum-exp of one head dim's problem.
struct Problem {
    head_dim: usize,
    qkv: [Tensor; 3],
    out: Tensor,
    dout: Tensor,
    grads: [Tensor; 3],
    lse: Tensor,
}

impl Problem {
    fn new(bench: &Bench, head_dim: usize) -> Problem {
        let shape = [BATCH, SEQ, HEADS * head_dim];
        let bf16 = DType::BF16;
        Problem {
            head_dim,
            qkv: [41, 42, 43].map(|seed| bench.tensor(&shape, bf16, seed)),
            out: bench.empty(&shape, bf16),
            dout: bench.tensor(&shape, bf16, 44),
            grads: [0; 3].map(|_| bench.empty(&shape, bf16)),
            lse: bench.empty(&[BATCH, HEADS, SEQ], DType::F32),
        }
    }

    /// The forward (and the backward when `backward`), causal or not.
    fn pass(&self, gpu: &BackendRef, causal: bool, backward: bool) {
        let width = HEADS * self.head_dim;
        let heads = Layout::from_parts(
            &[BATCH, HEADS, SEQ, self.head_dim],
            &[SEQ * width, self.head_dim, width, 1],
            0,
        )
        .expect("layout");
        let lse_layout = Layout::contiguous(&[BATCH, HEADS, SEQ]);
        fn view<'a>(t: &'a Tensor, layout: &'a Layout) -> View<'a> {
            View {
                buffer: t.buffer(),
                layout,
                dtype: t.dtype(),
            }
        }
        let forward = AttentionForward {
            q: view(&self.qkv[0], &heads),
            k: view(&self.qkv[1], &heads),
            v: view(&self.qkv[2], &heads),
            scale: 1.0 / (self.head_dim as f64).sqrt(),
            causal,
            packed: None,
            dropout: None,
            out: view(&self.out, &heads),
            lse: View {
                buffer: self.lse.buffer(),
                layout: &lse_layout,
                dtype: DType::F32,
            },
        };
        gpu.attention(forward).expect("attention");
        if backward {
            gpu.attention_backward(AttentionBackward {
                forward,
                dout: view(&self.dout, &heads),
                dq: view(&self.grads[0], &heads),
                dk: view(&self.grads[1], &heads),
                dv: view(&self.grads[2], &heads),
            })
            .expect("attention backward");
        }
    }
}

/// Every engine at each of the target's shapes.
pub(crate) fn hopper_attention(bench: &mut Bench, compute: &CudaStream) {
    let gpu = bench.gpu.clone();
    for head_dim in [128, 64] {
        let problem = Problem::new(bench, head_dim);
        let io = (4 * BATCH * SEQ * HEADS * head_dim * 2) as u64;
        for causal in [true, false] {
            let scores = (BATCH * HEADS * SEQ * SEQ) as u64;
            let forward_flops = 4 * scores * head_dim as u64 / if causal { 2 } else { 1 };
            let mask = if causal { "causal" } else { "full" };
            for (engine, hopper) in [
                ("mma", Some("0")),
                ("wgmma", Some("1")),
                ("default", None),
                ("ws", Some("ws")),
                ("ws_overlap", Some("ws-overlap")),
                ("ws_pingpong", Some("ws-pingpong")),
            ] {
                super::attention_engine(hopper);
                let shape = format!("b{BATCH}_h{HEADS}_s{SEQ}_d{head_dim}");
                bench.case(
                    "hopper_attention",
                    &format!("bf16_{mask}_forward_{engine}_{shape}"),
                    Work {
                        bytes: io,
                        flops: forward_flops,
                    },
                    compute,
                    || problem.pass(&gpu, causal, false),
                );
                bench.case(
                    "hopper_attention",
                    &format!("bf16_{mask}_fwd_bwd_{engine}_{shape}"),
                    Work {
                        bytes: 2 * io,
                        flops: forward_flops * 7 / 2,
                    },
                    compute,
                    || problem.pass(&gpu, causal, true),
                );
            }
        }
    }
    super::attention_engine(None);
}
