//! The models' default training loss (the head fused with the loss, nn's `CausalLm::forward_loss`)
//! under the optimizer in backward: 20 steps of fused AdamW (PyTorch's defaults: lr 1e-3, weight
//! decay 1e-2) stepped by `InBackward` on the tiny GPT-2 (head tied to the embedding) and the tiny
//! Llama (its own head), once with the fused loss and once with the unfused one
//! (`LossPath::Unfused`), same seed, same batches.
//!
//! Tolerance (testkit's `loss_paths`, which states and justifies it): the two paths are the
//! same loss in f32 summed in different orders, so not bitwise; each step's loss within 1e-6
//! relative, each parameter within 2e-4 of its largest value, GPT-2's q/k/v bias within 1e-3
//! (its key third's gradient is 0 but for rounding noise, which Adam scales up). Measured: losses
//! 1.2e-7, parameters 4.1e-5 (GPT-2) and 2.4e-5 (Llama), GPT-2's q/k/v bias 2.1e-4; the test
//! prints them.
//!
//! The head's weight gets its gradient through the hooks: after the first step, the rows of the
//! head for tokens absent from the batch (which only the head's gradient reaches, also through
//! the tied embedding) have moved by more than AdamW's weight decay alone would move them.

use headroom_autograd_core::{BackendRef, Tensor};
use headroom_hooks::{InBackward, InBackwardConfig};
use headroom_nn::{CausalLm, LossPath};
use headroom_ops_cpu::CpuBackend;
use headroom_optim::{AdamConfig, Implementation};
use headroom_testkit::loss_paths::{tokens, LossPathGap, TinyLm, Trajectory};
use headroom_testkit::worst::nan_max;
use headroom_testkit::OptimSpec;

const STEPS: usize = 20;
const ROWS: usize = 4;
const SEED: u64 = 7;

/// `model` trained in backward by fused AdamW in 4 KiB buckets.
fn in_backward(model: &dyn CausalLm) -> InBackward {
    let adamw = OptimSpec::Adam {
        config: AdamConfig::adamw(),
        implementation: Implementation::Fused,
    };
    let config = InBackwardConfig {
        bucket_bytes: 4096,
        ..InBackwardConfig::default()
    };
    InBackward::new(adamw.build(model.parameters()).unwrap(), config).unwrap()
}

/// `lm` trained `STEPS` steps in backward with `loss`; `after_first` sees the model after the
/// first step.
fn train(
    cpu: &BackendRef,
    lm: TinyLm,
    loss: LossPath,
    after_first: &mut dyn FnMut(&dyn CausalLm),
) -> Trajectory {
    let model = lm.build(cpu, loss, SEED).unwrap();
    let stepper = in_backward(model.as_ref());
    let mut losses = Vec::with_capacity(STEPS);
    for step in 0..STEPS {
        // Two batches in turn: the model learns them, so the loss falls.
        let ids = tokens(cpu, lm, ROWS, step % 2).unwrap();
        let loss = model.forward_loss(&ids, &ids).unwrap();
        stepper.backward(&loss).unwrap();
        losses.push(loss.item().unwrap());
        if step == 0 {
            after_first(model.as_ref());
        }
    }
    Trajectory::of(model.as_ref(), losses).unwrap()
}

/// The head weight's values by name.
fn head_weight(lm: TinyLm, model: &dyn CausalLm) -> Tensor {
    model
        .named_parameters()
        .into_iter()
        .find(|(name, _)| name == lm.head_weight_name())
        .map(|(_, param)| param)
        .unwrap()
}

#[test]
fn in_backward_training_with_the_fused_loss_equals_the_unfused_loss() {
    let cpu = CpuBackend::new_ref();
    for lm in TinyLm::ALL {
        let initial = {
            let model = lm.build(&cpu, LossPath::Unfused, SEED).unwrap();
            head_weight(lm, model.as_ref()).to_vec::<f32>().unwrap()
        };
        let first_ids = tokens(&cpu, lm, ROWS, 0).unwrap().to_vec::<i64>().unwrap();
        let mut checked_head = false;
        let fused = train(&cpu, lm, LossPath::default(), &mut |model| {
            let head = head_weight(lm, model).to_vec::<f32>().unwrap();
            let width = head.len() / lm.vocab_size();
            let adamw = AdamConfig::adamw();
            let decay_only = 1.0 - adamw.lr * adamw.weight_decay;
            for token in (0..lm.vocab_size() as i64).filter(|t| !first_ids.contains(t)) {
                let row = token as usize * width..(token as usize + 1) * width;
                let moved = head[row.clone()]
                    .iter()
                    .zip(&initial[row])
                    .map(|(now, before)| (f64::from(*now) - f64::from(*before) * decay_only).abs())
                    .fold(0.0, nan_max);
                // Adam's first step moves every element with a gradient by about lr.
                assert!(moved > 0.5 * adamw.lr, "{} row {token}: {moved}", lm.name());
            }
            checked_head = true;
        });
        assert!(checked_head);
        let unfused = train(&cpu, lm, LossPath::Unfused, &mut |_| {});
        let model = lm.build(&cpu, LossPath::Unfused, SEED).unwrap();
        LossPathGap::between(&fused, &unfused)
            .assert_within(&format!("{} in backward", lm.name()), model.as_ref());
        // Training moved: the last loss is below the first.
        assert!(
            fused.losses[STEPS - 1] < fused.losses[0],
            "{:?}",
            fused.losses
        );
    }
}
