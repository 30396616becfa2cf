//! The per-token activation bytes of a Llama decoder layer ([`LlamaConfig::block_activation_terms`])
//! against the CPU allocator's requested bytes around one layer's forward, exactly, in f32,
//! bf16, f16 and f64; and the layer's saved tensors, by storage, against the formula's terms.
//!
//! When an op changes what it saves (a fused RMSNorm, SwiGLU or rotary kernel, attention over
//! un-repeated key/value heads), these tests fail with the measured and the predicted bytes and
//! every save the layer made, so the terms can be updated to match.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use headroom_autograd_core::{
    saved_tensor_hooks, uniform, BackendRef, DType, Generator, Packed, Tensor,
};
use headroom_nn::{LlamaConfig, LlamaForCausalLM, TokenPositions};
use headroom_ops_cpu::CpuBackend;

/// The allocator's requested bytes now (exact: no rounding to blocks).
fn requested(cpu: &BackendRef) -> i64 {
    cpu.memory_stats().requested_bytes.all.current
}

/// One save of the layer: what saved it, its bytes, its storage's address, and whether that
/// storage is a parameter's.
#[derive(Clone)]
struct Save {
    what: String,
    bytes: u64,
    address: u64,
    is_parameter: bool,
}

/// The saves as a failure message lists them: one line each, what saved it and its bytes.
fn describe(saves: &[Save]) -> String {
    saves
        .iter()
        .map(|save| format!("\n  {}: {} bytes", save.what, save.bytes))
        .collect()
}

/// What the first layer of a model did on `batch × seq` tokens.
struct LayerRun {
    /// Requested bytes after its forward minus before, its output held.
    kept: u64,
    /// Every save, in order.
    saves: Vec<Save>,
    /// The storages of its input and the rotary tables (allocated before the layer).
    outside: [u64; 3],
}

/// The first layer of `config` in `dtype` on `batch × seq` tokens.
fn first_layer(config: LlamaConfig, dtype: DType, batch: usize, seq: usize) -> LayerRun {
    let cpu = CpuBackend::new_ref();
    let model = LlamaForCausalLM::new(&cpu, config, dtype, &Arc::new(Generator::new(0))).unwrap();
    let hidden = config.hidden_size;
    let values: Vec<f64> = (0..batch * seq * hidden)
        .map(|i| uniform(0, i as u64) - 0.5)
        .collect();
    let input = Tensor::from_f64s(&cpu, &values, &[batch, seq, hidden], dtype).unwrap();
    // In a model the layer's input comes from the embedding, so its gradient is wanted.
    input.requires_grad_(true).unwrap();
    let (cos, sin) = model.model.rotary_emb.cos_sin(&cpu, seq, dtype).unwrap();
    let saves = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&saves);
    let before = requested(&cpu);
    let output = {
        let _hooks = saved_tensor_hooks(
            move |site, tensor| {
                record.lock().unwrap().push(Save {
                    what: format!(
                        "{} {:?} {:?} {:?}",
                        site.op, site.role, site.shape, site.dtype
                    ),
                    bytes: site.bytes,
                    address: tensor.buffer().address(),
                    is_parameter: site.is_parameter,
                });
                Ok(Box::new(tensor) as Packed)
            },
            |packed| Ok(packed.downcast_ref::<Tensor>().unwrap().clone()),
        );
        let positions = TokenPositions {
            cos: &cos,
            sin: &sin,
            packed: None,
        };
        model.model.layers[0].forward(&input, positions).unwrap()
    };
    let kept = (requested(&cpu) - before) as u64;
    assert_eq!(output.shape(), [batch, seq, hidden]);
    let saves = saves.lock().unwrap().clone();
    let outside = [&input, &cos, &sin].map(|t| t.buffer().address());
    LayerRun {
        kept,
        saves,
        outside,
    }
}

#[test]
fn a_layer_keeps_the_formulas_bytes_per_token_exactly() {
    let (batch, seq) = (2, 8);
    for config in [LlamaConfig::tiny(), LlamaConfig::qwen2_tiny()] {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let LayerRun { kept, saves, .. } = first_layer(config, dtype, batch, seq);
            let per_token = config.block_activation_bytes_per_token(dtype);
            assert_eq!(
                kept,
                per_token * (batch * seq) as u64,
                "{dtype:?}: the allocator kept {kept} bytes, the formula says {per_token} a \
                 token ({:?}); the layer saved:{}",
                config.block_activation_terms(dtype),
                describe(&saves)
            );
        }
    }
    // The tiny Llama (h 64, i 128, 4 query heads and 2 key/value heads of 16): in f32 3,352
    // bytes a token, in bf16 1,688.
    let tiny = LlamaConfig::tiny();
    assert_eq!(tiny.block_activation_bytes_per_token(DType::F32), 3_352);
    assert_eq!(tiny.block_activation_bytes_per_token(DType::BF16), 1_688);
}

#[test]
fn every_distinct_saved_storage_of_a_layer_is_a_term_of_the_formula() {
    let (batch, seq) = (2, 8);
    let tokens = (batch * seq) as u64;
    let config = LlamaConfig::tiny();
    for dtype in [DType::F32, DType::BF16] {
        let LayerRun {
            kept,
            saves,
            outside,
        } = first_layer(config, dtype, batch, seq);
        // The storages the layer allocated and saved, each once, in bytes per token: not the
        // parameters, the layer's input or the rotary tables.
        let mut storages: HashMap<u64, u64> = HashMap::new();
        for save in &saves {
            if !save.is_parameter && !outside.contains(&save.address) {
                let bytes = storages.entry(save.address).or_default();
                *bytes = (*bytes).max(save.bytes);
            }
        }
        let mut saved: Vec<u64> = storages.values().map(|bytes| bytes / tokens).collect();
        saved.sort_unstable();
        // The formula's terms but the output (kept for the next layer, not saved in this one).
        let terms = config.block_activation_terms(dtype);
        let (output, in_layer) = terms.split_last().unwrap();
        let mut expected: Vec<u64> = in_layer
            .iter()
            .map(|(_, bytes)| *bytes)
            .filter(|bytes| *bytes > 0)
            .collect();
        expected.sort_unstable();
        assert_eq!(
            saved,
            expected,
            "{dtype:?}: distinct saved storages per token against the terms; saves:{}",
            describe(&saves)
        );
        // Each storage is whole multiples of tokens, and with the output they are all it kept.
        assert!(storages.values().all(|bytes| bytes % tokens == 0));
        assert_eq!(
            storages.values().sum::<u64>() + output.1 * tokens,
            kept,
            "{dtype:?}"
        );
    }
}

#[test]
fn the_published_shapes_keep_what_the_formula_says() {
    // Llama-3.2-1B (h 2048, i 8192, 32 query heads and 8 key/value heads of 64): 151,688 bytes
    // a token in f32 and 75,912 in bf16, 16 layers; at batch 4 × 2048 tokens, 19.9 GB and
    // 9.9 GB of layers (before the fused ops and grouped-query attention: 278,664 and 151,688).
    let one_b = LlamaConfig::llama_3_2_1b();
    assert_eq!(one_b.block_activation_bytes_per_token(DType::F32), 151_688);
    assert_eq!(one_b.block_activation_bytes_per_token(DType::BF16), 75_912);
    // Llama-3.1-8B (h 4096, i 14336, 32 query heads and 8 key/value heads of 128) in bf16: a
    // layer run without checkpointing keeps 139,400 bytes a token (a checkpointed one keeps its
    // input, 8,192).
    let eight_b = LlamaConfig::llama_3_1_8b();
    assert_eq!(
        eight_b.block_activation_bytes_per_token(DType::BF16),
        139_400
    );
}
