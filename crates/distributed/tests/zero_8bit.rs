//! ZeRO-2 with bitsandbytes' 8-bit Adam on the CPU backend with the in-process communicator: a
//! chain of weights whose shards on 2 and 4 ranks are whole 256-element blocks, so each shard's
//! blockwise statistics are those of the same elements of the whole weight, and 20 steps equal
//! single-rank training bit for bit.

mod zero2;

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Tensor};
use headroom_distributed::{Communicator, InProcessGroup};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{Implementation, Optimizer, ParamGroup};
use headroom_testkit::inputs::Xorshift;
use zero2::zero2_in_backward;

const STEPS: usize = 20;
/// Examples per rank.
const PER_RANK: usize = 3;

/// Allocated bytes of a tensor of `bytes`: the allocator's 512-byte rounding.
fn block(bytes: u64) -> i64 {
    bytes.div_ceil(512) as i64 * 512
}

fn values(params: &[Tensor]) -> Vec<Vec<f32>> {
    params.iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
}

/// A chain of four 256×256 weights (no biases): every shard on 2 and 4 ranks is whole blocks
/// of 8-bit Adam's 256 elements, so its blockwise statistics are those of the same elements of
/// the whole weight.
fn chain(backend: &BackendRef) -> Vec<Tensor> {
    (0..4)
        .map(|i| {
            let values: Vec<f64> = (0..256 * 256)
                .map(|j| ((i * 7 + j) as f64 * 1e-3).sin() * 0.06)
                .collect();
            let w = Tensor::from_f64s(backend, &values, &[256, 256], DType::F32).unwrap();
            w.requires_grad_(true).unwrap();
            w
        })
        .collect()
}

/// The mean over rows `first..first + n` of step `step`'s batch of `sum(h²)`, `h` the chain's
/// output.
fn chain_loss(weights: &[Tensor], step: usize, first: usize, n: usize) -> Tensor {
    let backend = weights[0].backend();
    let mut random = Xorshift::new(500 + step as u64);
    let rows: Vec<f64> = (0..(first + n) * 256)
        .map(|_| f64::from(random.next_signed_f32()))
        .collect();
    let x = Tensor::from_f64s(backend, &rows[first * 256..], &[n, 256], DType::F32).unwrap();
    let mut h = x;
    for w in weights {
        h = h.linear(w, None).unwrap().tanh().unwrap();
    }
    h.mul(&h)
        .unwrap()
        .sum_all()
        .unwrap()
        .mul_scalar(1.0 / n as f64)
        .unwrap()
}

#[test]
fn zero2_steps_8_bit_adam_shards_like_the_whole_weights() {
    use headroom_optim::kernels::Adam8bitConfig;
    use headroom_optim::Adam8bit;
    let config = Adam8bitConfig {
        lr: 1e-3,
        ..Adam8bitConfig::adamw()
    };
    for world_size in [2, 4] {
        // One rank on the global batch, as `world_size` micro-batches in rank order.
        let cpu = CpuBackend::new_ref();
        let weights = chain(&cpu);
        let mut adam = Adam8bit::new(
            vec![ParamGroup::new(weights.clone(), config.clone())],
            Implementation::Fused,
        )
        .unwrap();
        let before = cpu.memory_stats().allocated_bytes.all.current;
        for step in 0..STEPS {
            for rank in 0..world_size {
                chain_loss(&weights, step, rank * PER_RANK, PER_RANK)
                    .mul_scalar(1.0 / world_size as f64)
                    .unwrap()
                    .backward()
                    .unwrap();
            }
            adam.step().unwrap();
            adam.zero_grad(true).unwrap();
        }
        let single_state = cpu.memory_stats().allocated_bytes.all.current - before;
        let expected = values(&weights);
        let ranks = InProcessGroup::ranks(world_size).unwrap();
        let results: Vec<(Vec<Vec<f32>>, i64)> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|comm| {
                    let config = config.clone();
                    scope.spawn(move || {
                        let cpu = CpuBackend::new_ref();
                        let weights = chain(&cpu);
                        let rank = comm.rank();
                        let in_backward =
                            zero2_in_backward(weights.clone(), config, Arc::new(comm), 300 << 10);
                        // As for the single rank: what the steps add (the state).
                        let before = cpu.memory_stats().allocated_bytes.all.current;
                        for step in 0..STEPS {
                            let loss = chain_loss(&weights, step, rank * PER_RANK, PER_RANK);
                            in_backward.backward(&loss).unwrap();
                        }
                        let state = cpu.memory_stats().allocated_bytes.all.current - before;
                        (values(&weights), state)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let chunk = (256 * 256 / world_size) as u64;
        for (rank, (params, state)) in results.iter().enumerate() {
            assert!(
                params == &expected,
                "{world_size} ranks, rank {rank}: 8-bit Adam on the shards differs"
            );
            // Two 8-bit moments and two absmax vectors (one f32 per 256 elements) per shard.
            assert_eq!(*state, 4 * (2 * block(chunk) + 2 * block(chunk / 256 * 4)));
        }
        // The single rank's: the same per element; the shards' absmax vectors of 4 ranks
        // (256 B) are rounded up to the allocator's 512-byte blocks, so 4 shards hold 8 KiB more.
        assert_eq!(single_state, 4 * (2 * 65536 + 2 * 1024));
    }
}
