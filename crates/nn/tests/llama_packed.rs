//! Packed variable-length sequences through the Llama model on the CPU: a batch of sequences laid
//! end to end with `cu_seqlens` (attention within each sequence, rotary positions restarting at
//! each start) gives the loss and the gradients of the same sequences right-padded into a batch.

use headroom_autograd_core::{DType, Generator, PackedSequences, Tensor};
use headroom_nn::{LlamaConfig, LlamaForCausalLM, Module, NnError};
use headroom_ops_cpu::CpuBackend;
use headroom_testkit::golden::backward_and_gradients;
use headroom_testkit::worst::nan_max;

/// Hugging Face's label for positions the loss skips.
const IGNORE: i64 = -100;

/// The loss and every parameter gradient of one forward and backward.
fn loss_and_grads(
    model: &LlamaForCausalLM,
    ids: &Tensor,
    labels: &Tensor,
    packed: Option<&PackedSequences>,
) -> (f64, Vec<Vec<f64>>) {
    model.zero_grad(true).unwrap();
    let logits = model.forward_packed(ids, packed).unwrap();
    let loss = model.loss(&logits, labels).unwrap();
    backward_and_gradients(&loss, &model.parameters()).unwrap()
}

#[test]
fn packed_sequences_give_the_loss_and_gradients_of_padding() {
    let cpu = CpuBackend::new_ref();
    let config = LlamaConfig::tiny();
    assert!(config.num_key_value_heads < config.num_attention_heads);
    let model = LlamaForCausalLM::new(&cpu, config, DType::F32, &Generator::new(7)).unwrap();
    let lengths = [5usize, 11, 8, 1];
    let longest = *lengths.iter().max().unwrap();
    let sequences: Vec<Vec<i64>> = lengths
        .iter()
        .enumerate()
        .map(|(n, &len)| {
            (0..len)
                .map(|i| ((i * 37 + n * 11 + 5) % 128) as i64)
                .collect()
        })
        .collect();
    // Padded: one row per sequence, pad id 0 after it, its labels skipped.
    let (mut padded_ids, mut padded_labels) = (Vec::new(), Vec::new());
    for sequence in &sequences {
        padded_ids.extend(
            sequence
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, longest - sequence.len())),
        );
        padded_labels.extend(
            sequence
                .iter()
                .copied()
                .chain(std::iter::repeat_n(IGNORE, longest - sequence.len())),
        );
    }
    let rows = [lengths.len(), longest];
    let padded_ids = Tensor::from_slice(&cpu, &padded_ids, &rows).unwrap();
    let padded_labels = Tensor::from_slice(&cpu, &padded_labels, &rows).unwrap();
    let padded = loss_and_grads(&model, &padded_ids, &padded_labels, None);
    // Packed: end to end; each sequence's first label skipped, so the last token of the one
    // before predicts nothing across the boundary (padding's last real token predicts a pad).
    let packed = PackedSequences::from_lengths(&cpu, &lengths).unwrap();
    let packed_ids: Vec<i64> = sequences.concat();
    let packed_labels: Vec<i64> = sequences
        .iter()
        .flat_map(|sequence| std::iter::once(IGNORE).chain(sequence[1..].iter().copied()))
        .collect();
    let tokens = [1, packed_ids.len()];
    let packed_ids = Tensor::from_slice(&cpu, &packed_ids, &tokens).unwrap();
    let packed_labels = Tensor::from_slice(&cpu, &packed_labels, &tokens).unwrap();
    let together = loss_and_grads(&model, &packed_ids, &packed_labels, Some(&packed));
    // The same predictions, summed in another order: equal within f32 rounding.
    let loss_error = (together.0 - padded.0).abs() / padded.0.abs();
    assert!(
        loss_error <= 4.0 * f64::from(f32::EPSILON),
        "loss {} vs {} ({loss_error:e})",
        together.0,
        padded.0
    );
    for ((name, _), (a, b)) in model
        .named_parameters()
        .iter()
        .zip(together.1.iter().zip(&padded.1))
    {
        let scale = b.iter().fold(1e-30f64, |m, v| nan_max(m, v.abs()));
        let error = a
            .iter()
            .zip(b)
            .fold(0.0f64, |m, (x, y)| nan_max(m, (x - y).abs()))
            / scale;
        assert!(error <= 1e-4, "{name}: {error:e}");
    }
}

#[test]
fn packed_ids_must_hold_the_boundaries_tokens() {
    let cpu = CpuBackend::new_ref();
    let model =
        LlamaForCausalLM::new(&cpu, LlamaConfig::tiny(), DType::F32, &Generator::new(7)).unwrap();
    let packed = PackedSequences::from_lengths(&cpu, &[3, 4]).unwrap();
    let ids = Tensor::from_slice(&cpu, &[1i64, 2, 3, 4, 5, 6], &[1, 6]).unwrap();
    let err = model.forward_packed(&ids, Some(&packed)).unwrap_err();
    assert!(
        matches!(&err, NnError::InvalidInput { reason, .. }
            if reason == "packed input ids must be [1, 7] for cu_seqlens [0, 3, 7], got [1, 6]"),
        "{err}"
    );
}
