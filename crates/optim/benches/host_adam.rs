//! The host's fused Adam over one large parameter, as `OffloadedAdam`'s host thread runs it: f32
//! (`adam_fused`) and bf16 with stochastic rounding and f32 moments (`adam_fused_stochastic`),
//! 4 Mi elements, on rayon's pool. Whether the CPU's FMA instructions are used (`mul_add` is a
//! C library call without them) decides most of it.
//!
//! Measured (2-core development host, criterion means, 4 Mi elements): f32 15.71 ms and bf16
//! stochastic 14.79 ms before the kernels ran under AVX2 and FMA (`with_fast_fma`); 8.05 ms and
//! 9.57 ms with them (1.95× and 1.55×), the same bits.

use criterion::Criterion;
use headroom_optim::kernels::{
    adam_fused, adam_fused_stochastic, bf16, AdamBuffers, AdamConfig, AdamStochasticBuffers,
    GradScaling,
};

/// Elements of the parameter.
const LEN: usize = 1 << 22;

fn bench(c: &mut Criterion) {
    let cfg = AdamConfig {
        lr: 1e-4,
        ..AdamConfig::adamw()
    };
    let grad: Vec<f32> = (0..LEN).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
    let (mut exp_avg, mut exp_avg_sq) = (vec![0.0f32; LEN], vec![0.0f32; LEN]);
    let mut param = vec![0.1f32; LEN];
    let mut step = 0;
    c.bench_function("host adam_fused f32, 4 Mi elements", |b| {
        b.iter(|| {
            step += 1;
            let bufs = AdamBuffers {
                param: &mut param,
                grad: &grad,
                exp_avg: &mut exp_avg,
                exp_avg_sq: &mut exp_avg_sq,
                max_exp_avg_sq: None,
            };
            adam_fused(&cfg, step, bufs, GradScaling::NONE).expect("step")
        })
    });
    let grad: Vec<bf16> = grad.iter().map(|&g| bf16::from_f32(g)).collect();
    let mut param = vec![bf16::from_f32(0.1); LEN];
    let mut step = 0;
    c.bench_function("host adam_fused_stochastic bf16, 4 Mi elements", |b| {
        b.iter(|| {
            step += 1;
            let bufs = AdamStochasticBuffers {
                param: &mut param,
                grad: &grad,
                exp_avg: &mut exp_avg,
                exp_avg_sq: &mut exp_avg_sq,
                max_exp_avg_sq: None,
            };
            adam_fused_stochastic(&cfg, step, 7, bufs, GradScaling::NONE).expect("step")
        })
    });
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion);
    criterion.final_summary();
}
