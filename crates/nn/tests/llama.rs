//! The Llama family on the CPU: Hugging Face's parameter names, order and shapes for the tiny
//! Llama and Qwen2, the published parameter counts of the Llama 3 shapes (from the configs,
//! nothing allocated), a bitwise safetensors round trip, typed errors for configs that cannot
//! build a model, Llama 3's rotary scaling against the formula in f64, the whole model's
//! gradients against central differences in f64, and a block runner that changes nothing.
//! The comparison with Hugging Face's own numbers is `llama_golden.rs`.

use std::sync::{Arc, Mutex};

use headroom_autograd_core::{
    cross_entropy, no_grad, BackendRef, DType, Generator, Reduction, Tensor,
};
use headroom_nn::Result as NnResult;
use headroom_nn::{
    apply_rotary, load_weights, save_weights, BlockForward, BlockRunner, BlockStack,
    Llama3RopeScaling, LlamaConfig, LlamaForCausalLM, Module, NnError, RotaryEmbedding,
};
use headroom_ops_cpu::CpuBackend;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// Token ids `[batch, seq]` below 128, a fixed pseudo-random pattern.
fn token_ids(batch: usize, seq: usize) -> Vec<i64> {
    (0..batch * seq)
        .map(|i| ((i * 37 + 11) % 128) as i64)
        .collect()
}

fn build(cpu: &BackendRef, config: LlamaConfig, dtype: DType, seed: u64) -> LlamaForCausalLM {
    LlamaForCausalLM::new(cpu, config, dtype, &Generator::new(seed)).unwrap()
}

/// Hugging Face's `named_parameters()` of a config's model, with its shapes.
fn hugging_face_names(config: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let hidden = config.hidden_size;
    let q_width = config.num_attention_heads * config.head_dim;
    let kv_width = config.num_key_value_heads * config.head_dim;
    let inner = config.intermediate_size;
    let mut res = vec![(
        "model.embed_tokens.weight".to_owned(),
        vec![config.vocab_size, hidden],
    )];
    for layer in 0..config.num_hidden_layers {
        let mut leaves = Vec::new();
        for (proj, width) in [
            ("q_proj", q_width),
            ("k_proj", kv_width),
            ("v_proj", kv_width),
        ] {
            leaves.push((format!("self_attn.{proj}.weight"), vec![width, hidden]));
            if config.qkv_bias {
                leaves.push((format!("self_attn.{proj}.bias"), vec![width]));
            }
        }
        leaves.push(("self_attn.o_proj.weight".into(), vec![hidden, q_width]));
        leaves.push(("mlp.gate_proj.weight".into(), vec![inner, hidden]));
        leaves.push(("mlp.up_proj.weight".into(), vec![inner, hidden]));
        leaves.push(("mlp.down_proj.weight".into(), vec![hidden, inner]));
        leaves.push(("input_layernorm.weight".into(), vec![hidden]));
        leaves.push(("post_attention_layernorm.weight".into(), vec![hidden]));
        res.extend(
            leaves
                .into_iter()
                .map(|(leaf, shape)| (format!("model.layers.{layer}.{leaf}"), shape)),
        );
    }
    res.push(("model.norm.weight".into(), vec![hidden]));
    if !config.tie_word_embeddings {
        res.push(("lm_head.weight".into(), vec![config.vocab_size, hidden]));
    }
    res
}

#[test]
fn tiny_llama_and_qwen2_have_hugging_faces_names_order_and_shapes() {
    for config in [LlamaConfig::tiny(), LlamaConfig::qwen2_tiny()] {
        let cpu = CpuBackend::new_ref();
        let model = build(&cpu, config, DType::F32, 0);
        let ours: Vec<(String, Vec<usize>)> = model
            .named_parameters()
            .into_iter()
            .map(|(name, param)| (name, param.shape().to_vec()))
            .collect();
        assert_eq!(ours, hugging_face_names(&config));
        assert_eq!(model.num_parameters(), config.num_parameters());
        assert_eq!(model.n_blocks(), 2);

        let ids = Tensor::from_slice(&cpu, &token_ids(2, 16), &[2, 16]).unwrap();
        let logits = model.forward(&ids).unwrap();
        assert_eq!(logits.shape(), [2, 16, 128]);
        assert_eq!(logits.dtype(), DType::F32);
        let loss = model.loss(&logits, &ids).unwrap();
        assert_eq!(loss.shape(), [] as [usize; 0]);
        assert_eq!(loss.dtype(), DType::F32);
        // Logits of N(0, 0.02²) weights are small: nearly uniform over 128 tokens.
        let loss = loss.to_vec_f64().unwrap()[0];
        assert!((loss - 128f64.ln()).abs() < 0.2, "loss {loss}");
    }
    let cpu = CpuBackend::new_ref();
    let names = build(&cpu, LlamaConfig::qwen2_tiny(), DType::F32, 0).parameter_names();
    assert!(names.contains(&"model.layers.1.self_attn.v_proj.bias".to_owned()));
    assert!(!names.iter().any(|n| n.contains("o_proj.bias")));
    assert!(!names.iter().any(|n| n.starts_with("lm_head")), "tied head");
}

#[test]
fn llama_3_shapes_have_the_published_parameter_counts() {
    assert_eq!(LlamaConfig::llama_3_2_1b().num_parameters(), 1_235_814_400);
    assert_eq!(LlamaConfig::llama_3_2_3b().num_parameters(), 3_212_749_824);
    assert_eq!(LlamaConfig::llama_3_1_8b().num_parameters(), 8_030_261_248);
    // The larger shapes find-max-model walks (Qwen2.5's 14B and 32B, Llama-3.1-70B).
    assert_eq!(LlamaConfig::qwen2_5_14b().num_parameters(), 14_770_033_664);
    assert_eq!(LlamaConfig::qwen2_5_32b().num_parameters(), 32_763_876_352);
    assert_eq!(
        LlamaConfig::llama_3_1_70b().num_parameters(),
        70_553_706_496
    );
    for name in LlamaConfig::STANDARD_NAMES {
        let config = LlamaConfig::named(name).unwrap();
        config.validate().unwrap();
        let hugging_face: usize = hugging_face_names(&config)
            .iter()
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum();
        assert_eq!(config.num_parameters(), hugging_face, "{name}");
    }
    assert_eq!(LlamaConfig::named("llama-3.2-1b").unwrap().head_dim, 64);
    assert!(LlamaConfig::named("llama-2-7b").is_none());
}

#[test]
fn safetensors_round_trip_is_bitwise_and_tied_files_omit_the_head() {
    for config in [LlamaConfig::tiny(), LlamaConfig::qwen2_tiny()] {
        let cpu = CpuBackend::new_ref();
        let saved = build(&cpu, config, DType::F32, 0);
        let bytes = save_weights(&saved).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let mut file_names: Vec<String> = file.names().into_iter().cloned().collect();
        file_names.sort();
        let mut expected = saved.parameter_names();
        expected.sort();
        assert_eq!(file_names, expected);
        assert_eq!(
            file_names.contains(&"lm_head.weight".to_owned()),
            !config.tie_word_embeddings
        );

        let loaded = build(&cpu, config, DType::F32, 1);
        loaded.load_hugging_face(&file).unwrap();
        for ((name, ours), (_, theirs)) in loaded
            .named_parameters()
            .into_iter()
            .zip(saved.named_parameters())
        {
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(&ours), bits(&theirs), "{name}");
        }
        let ids = Tensor::from_slice(&cpu, &token_ids(1, 8), &[1, 8]).unwrap();
        assert_eq!(
            loaded.forward(&ids).unwrap().to_vec::<f32>().unwrap(),
            saved.forward(&ids).unwrap().to_vec::<f32>().unwrap()
        );
    }
}

#[test]
fn hugging_face_files_may_carry_a_tied_head_and_rotary_buffers() {
    let model = build(
        &CpuBackend::new_ref(),
        LlamaConfig::qwen2_tiny(),
        DType::F32,
        0,
    );
    let bytes = save_weights(&model).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let head = vec![0u8; 128 * 64 * 4];
    let inv_freq = vec![0u8; 8 * 4];
    let mut entries: Vec<(String, TensorView<'_>)> = file.tensors();
    entries.push((
        "lm_head.weight".into(),
        TensorView::new(Dtype::F32, vec![128, 64], &head).unwrap(),
    ));
    entries.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        TensorView::new(Dtype::F32, vec![8], &inv_freq).unwrap(),
    ));
    let extended = safetensors::serialize(entries, &None).unwrap();
    let extended = SafeTensors::deserialize(&extended).unwrap();

    model.load_hugging_face(&extended).unwrap();
    // Loaded by plain names, the extra tensors are parameters the model does not have.
    let err = load_weights(&model, &extended, "").unwrap_err();
    assert!(
        matches!(&err, NnError::UnexpectedParameter { name } if name == "lm_head.weight"),
        "{err}"
    );
}

/// The reason of an `InvalidConfig`, or a panic naming what came instead.
fn invalid_reason(config: LlamaConfig) -> String {
    match config.validate() {
        Err(NnError::InvalidConfig { reason }) => {
            let cpu = CpuBackend::new_ref();
            let built = LlamaForCausalLM::new(&cpu, config, DType::F32, &Generator::new(0));
            assert!(matches!(built, Err(NnError::InvalidConfig { .. })));
            reason
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn configs_that_cannot_build_a_model_are_typed_errors() {
    let tiny = LlamaConfig::tiny();
    let reason = invalid_reason(LlamaConfig {
        num_attention_heads: 3,
        num_key_value_heads: 3,
        ..tiny
    });
    assert_eq!(
        reason,
        "3 attention heads do not divide a hidden size of 64"
    );
    let reason = invalid_reason(LlamaConfig {
        num_key_value_heads: 3,
        ..tiny
    });
    assert_eq!(reason, "3 key/value heads do not divide 4 attention heads");
    assert_eq!(
        invalid_reason(LlamaConfig {
            vocab_size: 0,
            ..tiny
        }),
        "vocab_size is 0"
    );
    assert_eq!(
        invalid_reason(LlamaConfig {
            num_key_value_heads: 0,
            ..tiny
        }),
        "num_key_value_heads is 0"
    );
    assert_eq!(
        invalid_reason(LlamaConfig {
            intermediate_size: 0,
            ..tiny
        }),
        "intermediate_size is 0"
    );
    assert_eq!(
        invalid_reason(LlamaConfig {
            head_dim: 15,
            ..tiny
        }),
        "head_dim 15 is odd; the rotary embedding rotates pairs"
    );
    assert_eq!(
        invalid_reason(LlamaConfig {
            rms_norm_eps: 0.0,
            ..tiny
        }),
        "rms_norm_eps is 0; it must be positive"
    );
    let inverted = Llama3RopeScaling {
        low_freq_factor: 4.0,
        high_freq_factor: 1.0,
        ..tiny.rope_scaling.unwrap()
    };
    assert_eq!(
        invalid_reason(LlamaConfig {
            rope_scaling: Some(inverted),
            ..tiny
        }),
        "rope scaling needs 0 < low_freq_factor < high_freq_factor, got 4 and 1"
    );
    for config in [
        LlamaConfig::tiny(),
        LlamaConfig::qwen2_tiny(),
        LlamaConfig::llama_3_2_1b(),
        LlamaConfig::llama_3_2_3b(),
        LlamaConfig::llama_3_1_8b(),
    ] {
        config.validate().unwrap();
    }
}

/// Hugging Face's `_compute_llama3_parameters` (or the default frequencies), in f64.
fn reference_inv_freq(config: &LlamaConfig) -> Vec<f64> {
    let dim = config.head_dim as f64;
    let default =
        (0..config.head_dim / 2).map(|i| 1.0 / config.rope_theta.powf(2.0 * i as f64 / dim));
    let Some(scaling) = config.rope_scaling else {
        return default.collect();
    };
    let original = scaling.original_max_position_embeddings as f64;
    let low_freq_wavelen = original / scaling.low_freq_factor;
    let high_freq_wavelen = original / scaling.high_freq_factor;
    default
        .map(|inv| {
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            if wavelen < high_freq_wavelen {
                inv
            } else if wavelen > low_freq_wavelen {
                inv / scaling.factor
            } else {
                let smooth = (original / wavelen - scaling.low_freq_factor)
                    / (scaling.high_freq_factor - scaling.low_freq_factor);
                (1.0 - smooth) * inv / scaling.factor + smooth * inv
            }
        })
        .collect()
}

#[test]
fn rotary_frequencies_follow_llama_3_scaling() {
    let tiny = LlamaConfig::tiny();
    for config in [
        tiny,
        LlamaConfig::qwen2_tiny(),
        LlamaConfig::llama_3_2_1b(),
        LlamaConfig::llama_3_1_8b(),
    ] {
        let ours = RotaryEmbedding::new(&config);
        let reference = reference_inv_freq(&config);
        assert_eq!(ours.inv_freq().len(), config.head_dim / 2);
        for (i, (&ours, theirs)) in ours.inv_freq().iter().zip(&reference).enumerate() {
            // Hugging Face computes in f32: a few roundings of 2^-24 each.
            let err = (f64::from(ours) - theirs).abs() / theirs;
            assert!(err < 1e-6, "frequency {i}: {ours} vs {theirs} ({err:e})");
        }
    }
    // The tiny config exercises each band: 4 frequencies kept, 1 interpolated, 3 stretched.
    let unscaled = reference_inv_freq(&LlamaConfig {
        rope_scaling: None,
        ..tiny
    });
    let scaled = reference_inv_freq(&tiny);
    let ratios: Vec<f64> = unscaled.iter().zip(&scaled).map(|(u, s)| u / s).collect();
    assert!(ratios[..4].iter().all(|&r| r == 1.0), "{ratios:?}");
    assert!(ratios[4] > 1.0 && ratios[4] < 8.0, "{ratios:?}");
    assert!(
        ratios[5..].iter().all(|&r| (r - 8.0).abs() < 1e-12),
        "{ratios:?}"
    );
}

/// The causal-LM loss computed in f64 throughout (Hugging Face's upcasts the logits to f32,
/// which finite differences cannot see through).
fn f64_loss(model: &LlamaForCausalLM, ids: &Tensor) -> Tensor {
    let [batch, seq] = *ids.shape() else {
        unreachable!()
    };
    let logits = model.forward(ids).unwrap();
    let vocab = logits.shape()[2];
    let predictions = logits
        .narrow(1, 0, seq - 1)
        .unwrap()
        .reshape(&[batch * (seq - 1), vocab])
        .unwrap();
    let ids_vec = ids.to_vec::<i64>().unwrap();
    let targets: Vec<i64> = (0..batch)
        .flat_map(|row| ids_vec[row * seq + 1..(row + 1) * seq].to_vec())
        .collect();
    let targets = Tensor::from_slice(ids.backend(), &targets, &[batch * (seq - 1)]).unwrap();
    cross_entropy(&predictions, &targets, -100, Reduction::Mean).unwrap()
}

/// The f64 loss with element `idx` of `param` set to `value` (left so).
fn loss_at(model: &LlamaForCausalLM, ids: &Tensor, param: &Tensor, idx: usize, value: f64) -> f64 {
    let _guard = no_grad();
    let mut values = param.to_vec_f64().unwrap();
    values[idx] = value;
    let source = Tensor::from_f64s(param.backend(), &values, param.shape(), DType::F64).unwrap();
    param.copy_(&source).unwrap();
    f64_loss(model, ids).to_vec_f64().unwrap()[0]
}

#[test]
fn gradients_match_central_differences_in_f64() {
    for config in [LlamaConfig::tiny(), LlamaConfig::qwen2_tiny()] {
        let cpu = CpuBackend::new_ref();
        let model = build(&cpu, config, DType::F64, 0);
        let ids = Tensor::from_slice(&cpu, &token_ids(2, 8), &[2, 8]).unwrap();
        f64_loss(&model, &ids).backward().unwrap();
        let mut checked = 0;
        for (name, param) in model.named_parameters() {
            let grad = param.grad().unwrap().to_vec_f64().unwrap();
            // The two elements with the largest gradients: a tiny one is all rounding.
            let mut order: Vec<usize> = (0..grad.len()).collect();
            order.sort_by(|&a, &b| grad[b].abs().total_cmp(&grad[a].abs()));
            for &idx in &order[..2] {
                let original = param.to_vec_f64().unwrap()[idx];
                // Richardson's extrapolation of central differences at h and h/2: error O(h⁴).
                let step = 1e-4;
                let central = |h: f64| {
                    let plus = loss_at(&model, &ids, &param, idx, original + h);
                    let minus = loss_at(&model, &ids, &param, idx, original - h);
                    (plus - minus) / (2.0 * h)
                };
                let numeric = (4.0 * central(step / 2.0) - central(step)) / 3.0;
                loss_at(&model, &ids, &param, idx, original);
                let err = (numeric - grad[idx]).abs() / grad[idx].abs();
                assert!(
                    err <= 1e-6,
                    "{name}[{idx}]: analytic {:e}, numeric {numeric:e} ({err:e})",
                    grad[idx]
                );
                checked += 1;
            }
        }
        assert_eq!(checked, 2 * hugging_face_names(&config).len());
    }
}

/// Runs each block twice, once without recording (what a checkpoint's recompute relies on:
/// the same bits), and notes the indices.
#[derive(Debug, Default)]
struct RunTwice(Mutex<Vec<usize>>);

impl BlockRunner for RunTwice {
    fn run(&self, index: usize, block: BlockForward, input: &Tensor) -> NnResult<Tensor> {
        self.0.lock().unwrap().push(index);
        let replay = {
            let _guard = no_grad();
            block(input)?
        };
        let out = block(input)?;
        assert_eq!(
            bits(&replay),
            bits(&out),
            "block {index} is not deterministic"
        );
        Ok(out)
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn a_block_runner_changes_no_gradient_bit() {
    let run = |runner: Option<Arc<RunTwice>>| -> (Vec<u32>, Vec<Vec<u32>>) {
        let cpu = CpuBackend::new_ref();
        let mut model = build(&cpu, LlamaConfig::tiny(), DType::F32, 3);
        if let Some(runner) = runner {
            model.set_block_runner(Some(runner as Arc<dyn BlockRunner>));
            assert!(model.block_runner().is_some());
        }
        let ids = Tensor::from_slice(&cpu, &token_ids(2, 16), &[2, 16]).unwrap();
        let loss = model.loss(&model.forward(&ids).unwrap(), &ids).unwrap();
        loss.backward().unwrap();
        let grads = model
            .parameters()
            .iter()
            .map(|p| bits(&p.grad().unwrap()))
            .collect();
        (bits(&loss), grads)
    };
    let direct = run(None);
    let runner = Arc::new(RunTwice::default());
    let through_runner = run(Some(Arc::clone(&runner)));
    assert_eq!(*runner.0.lock().unwrap(), [0, 1]);
    assert_eq!(direct, through_runner);
}

#[test]
fn input_ids_must_be_batch_by_seq() {
    let cpu = CpuBackend::new_ref();
    let model = build(&cpu, LlamaConfig::tiny(), DType::F32, 0);
    let flat = Tensor::from_slice(&cpu, &token_ids(1, 8), &[8]).unwrap();
    let err = model.forward(&flat).unwrap_err();
    assert!(
        matches!(&err, NnError::InvalidInput { module: "LlamaModel", reason }
            if reason == "expected input ids [batch, seq], got [8]"),
        "{err}"
    );
}

#[test]
fn rotary_embedding_rotates_each_half_pair_by_position_times_frequency() {
    let cpu = CpuBackend::new_ref();
    let config = LlamaConfig::tiny();
    let rotary = RotaryEmbedding::new(&config);
    let (seq, dim, half) = (5, config.head_dim, config.head_dim / 2);
    let values: Vec<f64> = (0..seq * dim)
        .map(|i| ((i * 7919) % 13) as f64 - 6.0)
        .collect();
    let x = Tensor::from_f64s(&cpu, &values, &[1, 1, seq, dim], DType::F64).unwrap();
    let (cos, sin) = rotary.cos_sin(&cpu, seq, DType::F64).unwrap();
    let rotated = apply_rotary(&x, &cos, &sin).unwrap().to_vec_f64().unwrap();
    for pos in 0..seq {
        for i in 0..half {
            // Element i and element i + half are one pair (`rotate_half`, not interleaved).
            let angle = pos as f64 * f64::from(rotary.inv_freq()[i]);
            let (a, b) = (values[pos * dim + i], values[pos * dim + i + half]);
            let expected = [
                a * angle.cos() - b * angle.sin(),
                b * angle.cos() + a * angle.sin(),
            ];
            let ours = [rotated[pos * dim + i], rotated[pos * dim + i + half]];
            for (o, e) in ours.iter().zip(expected) {
                // The tables are f32, as Hugging Face's.
                assert!(
                    (o - e).abs() <= 1e-6 * 6.0,
                    "position {pos}, pair {i}: {o} vs {e}"
                );
            }
        }
    }
}

#[test]
fn a_token_changes_no_logit_before_it() {
    let cpu = CpuBackend::new_ref();
    let model = build(&cpu, LlamaConfig::tiny(), DType::F64, 0);
    let mut ids = token_ids(1, 12);
    let before = Tensor::from_slice(&cpu, &ids, &[1, 12]).unwrap();
    let before = model.forward(&before).unwrap().to_vec_f64().unwrap();
    ids[8] = (ids[8] + 1) % 128;
    let after = Tensor::from_slice(&cpu, &ids, &[1, 12]).unwrap();
    let after = model.forward(&after).unwrap().to_vec_f64().unwrap();
    let vocab = 128;
    assert_eq!(before[..8 * vocab], after[..8 * vocab]);
    assert_ne!(before[8 * vocab..9 * vocab], after[8 * vocab..9 * vocab]);
}
