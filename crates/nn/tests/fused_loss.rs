//! The models' fused causal-LM loss (`loss_from_hidden`, the head and the loss in one
//! `linear_cross_entropy`) against their unfused `loss(forward(ids))`: the same loss and the
//! same gradient for every parameter (the tied embedding's included), in f32 on the CPU,
//! with chunks that do not divide the token count; and their training loss,
//! `CausalLm::forward_loss`, fused by default and the unfused `loss(forward(ids))` to the bit with
//! `LossPath::Unfused`.

use headroom_autograd_core::{BackendRef, DType, Generator, LinearCrossEntropyOptions, Tensor};
use headroom_nn::{
    CausalLm, Gpt2Config, Gpt2LMHeadModel, LlamaConfig, LlamaForCausalLM, LossPath, Module,
};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::golden::backward_and_gradients;
use headroom_testkit::worst::{abs_difference, nan_max};

const BATCH: usize = 2;
const SEQ: usize = 5;

fn token_ids(cpu: &BackendRef, vocab: usize) -> Tensor {
    let ids: Vec<i64> = (0..BATCH * SEQ)
        .map(|i| ((i * 7 + 3) % vocab) as i64)
        .collect();
    Tensor::from_slice(cpu, &ids, &[BATCH, SEQ]).unwrap()
}

/// Chunks of 3 token rows of `vocab` f32 logits (10 tokens: 3 + 3 + 3 + 1).
fn three_rows(vocab: usize) -> LinearCrossEntropyOptions {
    LinearCrossEntropyOptions {
        chunk_bytes: 3 * (vocab * 4 + 64),
        ..LinearCrossEntropyOptions::default()
    }
}

/// The loss and every parameter's gradient after `step` runs backward.
fn loss_and_grads(model: &dyn Module, step: impl FnOnce() -> Tensor) -> (f64, Vec<Vec<f64>>) {
    for param in model.parameters() {
        param.zero_grad(true).unwrap();
    }
    backward_and_gradients(&step(), &model.parameters()).unwrap()
}

fn assert_close(name: &str, fused: &(f64, Vec<Vec<f64>>), unfused: &(f64, Vec<Vec<f64>>)) {
    assert!(
        (fused.0 - unfused.0).abs() <= 1e-6 * unfused.0.abs(),
        "{name}: loss {} vs {}",
        fused.0,
        unfused.0
    );
    for (ours, theirs) in fused.1.iter().zip(&unfused.1) {
        let scale = theirs.iter().fold(1e-6, |m, v| nan_max(m, v.abs()));
        let error = abs_difference(ours, theirs);
        assert!(
            error <= 1e-5 * scale,
            "{name}: gradient error {error} of scale {scale}"
        );
    }
}

#[test]
fn gpt2_fused_loss_equals_its_unfused_loss_and_gradients() {
    let cpu = CpuBackend::new_ref();
    let config = Gpt2Config::tiny();
    let vocab = config.vocab_size;
    let model = Gpt2LMHeadModel::new(
        &cpu,
        config,
        DType::F32,
        &std::sync::Arc::new(Generator::new(1)),
    )
    .unwrap();
    let ids = token_ids(&cpu, vocab);
    let unfused = loss_and_grads(&model, || {
        model.loss(&model.forward(&ids).unwrap(), &ids).unwrap()
    });
    let fused = loss_and_grads(&model, || {
        let hidden = model.transformer.forward(&ids).unwrap();
        model
            .loss_from_hidden(&hidden, &ids, &three_rows(vocab))
            .unwrap()
    });
    assert_close("gpt2", &fused, &unfused);
}

#[test]
fn llama_fused_loss_equals_its_unfused_loss_tied_or_not() {
    let cpu = CpuBackend::new_ref();
    for config in [LlamaConfig::tiny(), LlamaConfig::qwen2_tiny()] {
        let tied = config.tie_word_embeddings;
        let vocab = config.vocab_size;
        let model = LlamaForCausalLM::new(&cpu, config, DType::F32, &Generator::new(2)).unwrap();
        let ids = token_ids(&cpu, vocab);
        let unfused = loss_and_grads(&model, || {
            model.loss(&model.forward(&ids).unwrap(), &ids).unwrap()
        });
        let fused = loss_and_grads(&model, || {
            let hidden = model.model.forward(&ids).unwrap();
            model
                .loss_from_hidden(&hidden, &ids, &three_rows(vocab))
                .unwrap()
        });
        assert_close(if tied { "llama tied" } else { "llama" }, &fused, &unfused);
    }
}

#[test]
fn the_fused_loss_checks_its_shapes() {
    let cpu = CpuBackend::new_ref();
    let config = LlamaConfig::tiny();
    let model = LlamaForCausalLM::new(&cpu, config, DType::F32, &Generator::new(3)).unwrap();
    let ids = token_ids(&cpu, 8);
    let flat = Tensor::zeros(&cpu, &[BATCH * SEQ, 4], DType::F32).unwrap();
    let err = model
        .loss_from_hidden(&flat, &ids, &LinearCrossEntropyOptions::default())
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("expected hidden states [batch, seq, features]"),
        "{err}"
    );
    let hidden = Tensor::zeros(&cpu, &[BATCH, SEQ + 1, 4], DType::F32).unwrap();
    let err = model
        .loss_from_hidden(&hidden, &ids, &LinearCrossEntropyOptions::default())
        .unwrap_err();
    assert!(
        err.to_string().contains("do not match hidden states"),
        "{err}"
    );
}

/// `forward_loss` of `model` on its default path (which must be the fused one with the default
/// options), then with [`LossPath::Unfused`] (which must be `loss(forward(ids))` to the bit):
/// the two paths' losses and gradients within [`assert_close`]'s bounds.
fn check_forward_loss<M: CausalLm>(
    name: &str,
    model: &mut M,
    ids: &Tensor,
    path: fn(&mut M) -> &mut LossPath,
    unfused: impl Fn(&M) -> Tensor,
) {
    assert_eq!(
        *path(model),
        LossPath::Fused(LinearCrossEntropyOptions::default()),
        "{name}"
    );
    let fused = loss_and_grads(model, || model.forward_loss(ids, ids).unwrap());
    *path(model) = LossPath::Unfused;
    let through_the_logits = loss_and_grads(model, || unfused(model));
    let switched_off = loss_and_grads(model, || model.forward_loss(ids, ids).unwrap());
    assert_eq!(switched_off, through_the_logits, "{name}");
    assert_close(name, &fused, &switched_off);
}

#[test]
fn forward_loss_is_fused_by_default_and_the_logits_path_when_switched_off() {
    let cpu = CpuBackend::new_ref();
    let config = Gpt2Config::tiny();
    let mut gpt2 = Gpt2LMHeadModel::new(
        &cpu,
        config,
        DType::F32,
        &std::sync::Arc::new(Generator::new(4)),
    )
    .unwrap();
    let ids = token_ids(&cpu, config.vocab_size);
    check_forward_loss(
        "gpt2",
        &mut gpt2,
        &ids,
        |m| &mut m.loss_path,
        |m| m.loss(&m.forward(&ids).unwrap(), &ids).unwrap(),
    );
    for config in [LlamaConfig::tiny(), LlamaConfig::qwen2_tiny()] {
        let mut llama =
            LlamaForCausalLM::new(&cpu, config, DType::F32, &Generator::new(5)).unwrap();
        let ids = token_ids(&cpu, config.vocab_size);
        check_forward_loss(
            "llama",
            &mut llama,
            &ids,
            |m| &mut m.loss_path,
            |m| m.loss(&m.forward(&ids).unwrap(), &ids).unwrap(),
        );
    }
}
