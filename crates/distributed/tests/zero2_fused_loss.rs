//! The models' default training loss (the head fused with the loss, nn's `CausalLm::forward_loss`)
//! under ZeRO-2: the tiny GPT-2 (head tied to the embedding) and the tiny Llama (its own head) on
//! 2 in-process ranks, fused AdamW (PyTorch's defaults: lr 1e-3, weight decay 1e-2) sharded and
//! stepped in backward (`zero2/`), 20 steps once with the fused loss and once with the unfused one
//! (`LossPath::Unfused`), same seed, same batches (each rank its half of a global batch, two
//! global batches in turn so the loss falls).
//!
//! Every rank's loss at every step and every parameter after the last agree within testkit's
//! `loss_paths` bounds, which state and justify the tolerance (the two paths sum the same f32
//! loss in different orders; Adam magnifies the rounding where a gradient element is small, and
//! GPT-2's key bias has a gradient of 0 but for rounding). Measured: losses 1.3e-7, parameters
//! 4.2e-5 (GPT-2) and 4.9e-5 (Llama), GPT-2's q/k/v bias 3.2e-4; the test prints them.
//! The ranks end with the same parameters, to the bit, on either path.

mod zero2;

use std::sync::Arc;

use headroom_distributed::{Communicator, InProcessGroup};
use headroom_nn::LossPath;
use headroom_ops_cpu::CpuBackend;
use headroom_optim::AdamConfig;
use headroom_testkit::loss_paths::{tokens, LossPathGap, TinyLm, Trajectory};
use zero2::zero2_in_backward;

const STEPS: usize = 20;
const WORLD_SIZE: usize = 2;
/// Rows of each rank's half of a global batch.
const PER_RANK: usize = 2;
const SEED: u64 = 11;

/// One rank's run: its local losses and the parameters it ends with.
fn train_rank(lm: TinyLm, loss: LossPath, comm: Arc<dyn Communicator>) -> Trajectory {
    let cpu = CpuBackend::new_ref();
    let rank = comm.rank();
    let model = lm.build(&cpu, loss, SEED).unwrap();
    let stepper = zero2_in_backward(model.parameters(), AdamConfig::adamw(), comm, 4096);
    let mut losses = Vec::with_capacity(STEPS);
    for step in 0..STEPS {
        let global = tokens(&cpu, lm, WORLD_SIZE * PER_RANK, step % 2).unwrap();
        let ids = global
            .narrow(0, rank * PER_RANK, PER_RANK)
            .unwrap()
            .contiguous()
            .unwrap();
        let loss = model.forward_loss(&ids, &ids).unwrap();
        stepper.backward(&loss).unwrap();
        losses.push(loss.item().unwrap());
    }
    Trajectory::of(model.as_ref(), losses).unwrap()
}

/// Every rank of `lm` with `loss`, each on its own thread.
fn train(lm: TinyLm, loss: LossPath) -> Vec<Trajectory> {
    let ranks = InProcessGroup::ranks(WORLD_SIZE).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|comm| scope.spawn(move || train_rank(lm, loss, Arc::new(comm))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn zero2_training_with_the_fused_loss_equals_the_unfused_loss() {
    let cpu = CpuBackend::new_ref();
    for lm in TinyLm::ALL {
        let (fused, unfused) = (train(lm, LossPath::default()), train(lm, LossPath::Unfused));
        let names = lm.build(&cpu, LossPath::Unfused, SEED).unwrap();
        for (rank, (ours, reference)) in fused.iter().zip(&unfused).enumerate() {
            LossPathGap::between(ours, reference)
                .assert_within(&format!("{} ZeRO-2 rank {rank}", lm.name()), names.as_ref());
            assert!(
                ours.losses[STEPS - 1] < ours.losses[0],
                "{}: {:?}",
                lm.name(),
                ours.losses
            );
        }
        for run in [&fused, &unfused] {
            assert_eq!(
                run[0].params,
                run[1].params,
                "{}: the ranks differ",
                lm.name()
            );
        }
    }
}
