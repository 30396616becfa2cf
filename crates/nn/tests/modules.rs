//! Module behaviour beyond the golden models: weights survive a safetensors round trip (and a
//! dtype change), dropout follows the training flag through a whole model, a causal mask keeps
//! later tokens out of earlier positions, and the CPU benchmark ViT (`VitConfig::mini`) has its
//! documented size; fp8 tensors load from safetensors in their own dtype.

use std::sync::Arc;

use headroom_autograd_core::{BackendRef, DType, Generator, Tensor};
use headroom_nn::{
    causal_mask, load_weights, read_tensor, save_weights, AttentionMask, Dropout, Gpt2Config,
    Gpt2LMHeadModel, Module, MultiheadAttention, NnError, VisionTransformer, VitConfig,
};
use headroom_ops_cpu::CpuBackend;
use safetensors::SafeTensors;

fn values(module: &dyn Module) -> Vec<(String, Vec<f64>)> {
    module
        .named_parameters()
        .into_iter()
        .map(|(name, tensor)| (name, tensor.to_vec_f64().unwrap()))
        .collect()
}

#[test]
fn weights_round_trip_through_safetensors_by_name() {
    let cpu = CpuBackend::new_ref();
    let config = Gpt2Config::tiny();
    let source =
        Gpt2LMHeadModel::new(&cpu, config, DType::F64, &Arc::new(Generator::new(1))).unwrap();
    let bytes = save_weights(&source).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<&str> = file.names().into_iter().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(names.len(), 4 + 12 * config.n_layer);
    assert!(names.contains(&"transformer.h.1.mlp.c_fc.weight"));
    assert_eq!(
        file.tensor("transformer.h.0.attn.c_attn.weight")
            .unwrap()
            .shape(),
        [64, 192],
        "Conv1D weights are stored [in, out]"
    );

    let target =
        Gpt2LMHeadModel::new(&cpu, config, DType::F64, &Arc::new(Generator::new(2))).unwrap();
    assert_ne!(values(&target), values(&source));
    load_weights(&target, &file, "").unwrap();
    assert_eq!(values(&target), values(&source));

    // Loading f64 weights into an f32 model converts them.
    let narrow =
        Gpt2LMHeadModel::new(&cpu, config, DType::F32, &Arc::new(Generator::new(3))).unwrap();
    load_weights(&narrow, &file, "").unwrap();
    for ((name, ours), (_, theirs)) in values(&narrow).iter().zip(values(&source).iter()) {
        for (a, b) in ours.iter().zip(theirs) {
            assert_eq!(*a, f64::from(*b as f32), "{name}");
        }
    }

    // A prefix that names nothing leaves every parameter missing; the first is reported.
    let err = load_weights(&target, &file, "model.").unwrap_err();
    assert!(
        matches!(&err, NnError::MissingParameter { name } if name == "transformer.wte.weight"),
        "{err}"
    );
}

#[test]
fn dropout_follows_the_training_flag_through_the_model() {
    let cpu = CpuBackend::new_ref();
    let generator = Arc::new(Generator::new(7));
    let dropout = Dropout::new(0.5, Arc::clone(&generator));
    let ones = Tensor::ones(&cpu, &[4096], DType::F64).unwrap();
    let dropped = dropout.forward(&ones).unwrap().to_vec_f64().unwrap();
    assert!(dropped.iter().all(|&v| v == 0.0 || v == 2.0));
    let kept = dropped.iter().filter(|&&v| v == 2.0).count();
    assert!(
        (1800..2300).contains(&kept),
        "{kept} of 4096 kept at p = 0.5"
    );

    let config = VitConfig {
        dropout: 0.5,
        attention_dropout: 0.5,
        ..VitConfig::tiny()
    };
    let mut model = VisionTransformer::new(&cpu, config, DType::F64, &generator).unwrap();
    // The zero-initialised head makes every logit 0; give it weights so dropout shows.
    model.head = headroom_nn::Linear::new(&cpu, 64, 10, true, DType::F64, &generator).unwrap();
    let images = Tensor::ones(&cpu, &[1, 3, 32, 32], DType::F64).unwrap();
    let run = |model: &VisionTransformer| model.forward(&images).unwrap().to_vec_f64().unwrap();
    assert_ne!(run(&model), run(&model), "training: two draws differ");
    model.set_training(false);
    assert_eq!(run(&model), run(&model), "evaluation: deterministic");
}

#[test]
fn a_causal_mask_keeps_later_tokens_out_of_earlier_positions() {
    let cpu: BackendRef = CpuBackend::new_ref();
    let generator = Arc::new(Generator::new(11));
    let attention = MultiheadAttention::new(
        &cpu,
        16,
        4,
        Dropout::new(0.0, Arc::clone(&generator)),
        DType::F64,
        &generator,
    )
    .unwrap();
    let mask = causal_mask(&cpu, 5).unwrap();
    assert_eq!(
        mask.to_vec_f64().unwrap()[..10],
        [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    );
    let tokens: Vec<f64> = (0..80).map(|i| ((i * 7) % 13) as f64 / 13.0).collect();
    let mut changed = tokens.clone();
    changed[79] += 1.0; // the last token only
    let run = |values: &[f64], mask: AttentionMask<'_>| {
        let x = Tensor::from_f64s(&cpu, values, &[1, 5, 16], DType::F64).unwrap();
        attention.forward(&x, mask).unwrap().to_vec_f64().unwrap()
    };
    // The masked math path and the fused causal kernel.
    for mask in [AttentionMask::Custom(&mask), AttentionMask::Causal] {
        let (before, after) = (run(&tokens, mask), run(&changed, mask));
        assert_eq!(
            before[..64],
            after[..64],
            "positions 0..4 do not see token 4"
        );
        assert_ne!(before[64..], after[64..], "position 4 sees itself");
    }
    let (math, fused) = (
        run(&tokens, AttentionMask::Custom(&mask)),
        run(&tokens, AttentionMask::Causal),
    );
    for (m, f) in math.iter().zip(&fused) {
        assert!((m - f).abs() <= 1e-14 * m.abs().max(1.0), "{m} vs {f}");
    }
}

#[test]
fn the_mini_vit_has_the_documented_size() {
    let cpu = CpuBackend::new_ref();
    let config = VitConfig::mini();
    let model =
        VisionTransformer::new(&cpu, config, DType::F32, &Arc::new(Generator::new(0))).unwrap();
    assert_eq!(model.num_parameters(), 5_197_544);
    assert_eq!(config.seq_length(), 17);
    let images = Tensor::zeros(&cpu, &[2, 3, 64, 64], DType::F32).unwrap();
    assert_eq!(model.forward(&images).unwrap().shape(), [2, 1000]);
}

#[test]
fn parameters_drawn_across_threads_equal_the_sequential_draws() {
    use headroom_autograd_core::uniform;
    use headroom_nn::{parameter, Init};
    let cpu = CpuBackend::new_ref();
    // Large enough to be split across rayon's threads; each element must still be the
    // closed-form draw of its own index.
    let numel = 200_003;
    let generator = Generator::new(11);
    generator.advance(5);
    let normal = Init::normal(0.5, 0.02);
    let drawn = parameter(&cpu, &[numel], DType::F32, normal, &generator).unwrap();
    let uniform_bf16 = Init::uniform(-0.1, 0.3);
    let drawn_bf16 = parameter(&cpu, &[numel], DType::BF16, uniform_bf16, &generator).unwrap();
    assert_eq!(generator.state().offset, 5 + 3 * numel as u64);
    let normal_at = |i: u64| {
        let u1 = 1.0 - uniform(11, 5 + 2 * i);
        let u2 = uniform(11, 5 + 2 * i + 1);
        0.5 + 0.02 * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    };
    let want: Vec<f64> = (0..numel as u64)
        .map(|i| normal_at(i) as f32 as f64)
        .collect();
    assert_eq!(drawn.to_vec_f64().unwrap(), want);
    let offset = 5 + 2 * numel as u64;
    // Rounded to nearest from the f64 draw (ops-cpu's f64 -> bf16 copy), with no double
    // rounding through f32.
    let rounded = |offset: u64, dtype: DType| {
        let values: Vec<f64> = (0..numel as u64)
            .map(|i| -0.1 + 0.4 * uniform(11, offset + i))
            .collect();
        let exact = Tensor::from_slice(&cpu, &values, &[numel]).unwrap();
        exact.to_dtype(dtype).unwrap().to_vec_f64().unwrap()
    };
    assert_eq!(
        drawn_bf16.to_vec_f64().unwrap(),
        rounded(offset, DType::BF16)
    );
    let drawn_f16 = parameter(&cpu, &[numel], DType::F16, uniform_bf16, &generator).unwrap();
    let offset = 5 + 3 * numel as u64;
    assert_eq!(drawn_f16.to_vec_f64().unwrap(), rounded(offset, DType::F16));
}

/// An archive's E4M3 and E5M2 tensors (codes written as bytes, as PyTorch's safetensors writes
/// `float8_e4m3fn` and `float8_e5m2`) load in those dtypes with their values.
#[test]
fn float8_tensors_load_from_safetensors() {
    let cpu: BackendRef = CpuBackend::new_ref();
    // E4M3: 1.0, -2.0, 448 (0x7e), the smallest subnormal 2^-9; E5M2: 1.0, 57344 (0x7b).
    let e4m3 = [0x38u8, 0xc0, 0x7e, 0x01];
    let e5m2 = [0x3cu8, 0x7b];
    let views = vec![
        (
            "a",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F8_E4M3, vec![2, 2], &e4m3)
                .unwrap(),
        ),
        (
            "b",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F8_E5M2, vec![2], &e5m2)
                .unwrap(),
        ),
    ];
    let bytes = safetensors::serialize(views, &None).unwrap();
    let archive = SafeTensors::deserialize(&bytes).unwrap();
    let a = read_tensor(&cpu, &archive, "a").unwrap();
    assert_eq!((a.dtype(), a.shape()), (DType::F8E4M3, &[2, 2][..]));
    assert_eq!(a.to_vec_f64().unwrap(), [1.0, -2.0, 448.0, 2f64.powi(-9)]);
    let b = read_tensor(&cpu, &archive, "b").unwrap();
    assert_eq!(b.dtype(), DType::F8E5M2);
    assert_eq!(b.to_vec_f64().unwrap(), [1.0, 57344.0]);
}
