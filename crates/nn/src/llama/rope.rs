//! Rotary position embeddings as Hugging Face's Llama computes them: the inverse frequencies
//! (with Llama 3's scaling, `_compute_llama3_parameters`), the cos/sin tables, and
//! `apply_rotary_pos_emb` with the `rotate_half` convention (the two halves of a head are the
//! pairs, not interleaved elements).
//!
//! Hugging Face computes the frequencies and the tables in f32 whatever the model's dtype (its
//! `inv_freq` buffer is f32, the angle is an f32 product, `cos`/`sin` are taken in f32 and then
//! cast), so this module does each step in f32 in the same order, and the tables reach an f64
//! model carrying the same f32 rounding. The tables are constants (no gradient); applying them is
//! autograd-core's fused `rotary_embedding`, whose backward rotates the output gradient back, so
//! no activation is saved for it. This module knows nothing about attention.

use headroom_autograd_core::{rotary_embedding, BackendRef, DType, Tensor};

use super::config::LlamaConfig;
use crate::error::Result;

/// A head's rotary inverse frequencies, and the tables built from them.
#[derive(Debug, Clone, PartialEq)]
pub struct RotaryEmbedding {
    /// `head_dim / 2` inverse frequencies, f32 as Hugging Face's `inv_freq` buffer.
    inv_freq: Vec<f32>,
}

impl RotaryEmbedding {
    /// The inverse frequencies of `config`'s heads: `1 / theta^(2i / head_dim)`, then Llama 3's
    /// scaling when the config has one.
    pub fn new(config: &LlamaConfig) -> RotaryEmbedding {
        let dim = config.head_dim;
        // `base ** (arange(0, dim, 2).float() / dim)` in f32, then its reciprocal.
        let theta = config.rope_theta as f32;
        let default: Vec<f32> = (0..dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / dim as f32;
                1.0 / (f64::from(theta).powf(f64::from(exponent)) as f32)
            })
            .collect();
        let inv_freq = match config.rope_scaling {
            None => default,
            Some(scaling) => {
                // Python computes the scalars in f64; torch meets them with an f32 tensor as f32.
                let factor = scaling.factor as f32;
                let low = scaling.low_freq_factor as f32;
                let band = (scaling.high_freq_factor - scaling.low_freq_factor) as f32;
                let original = scaling.original_max_position_embeddings as f64;
                let low_freq_wavelen = (original / scaling.low_freq_factor) as f32;
                let high_freq_wavelen = (original / scaling.high_freq_factor) as f32;
                let original = original as f32;
                let two_pi = std::f32::consts::TAU;
                default
                    .iter()
                    .map(|&inv| {
                        // `2 * math.pi / inv_freq` is `inv_freq.reciprocal() * (2 pi)` in torch.
                        let wavelen = (1.0 / inv) * two_pi;
                        let stretched = if wavelen > low_freq_wavelen {
                            inv / factor
                        } else {
                            inv
                        };
                        let smooth = ((1.0 / wavelen) * original - low) / band;
                        let smoothed = (1.0 - smooth) * stretched / factor + smooth * stretched;
                        let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                        if is_medium {
                            smoothed
                        } else {
                            stretched
                        }
                    })
                    .collect()
            }
        };
        RotaryEmbedding { inv_freq }
    }

    /// The `head_dim / 2` inverse frequencies (Hugging Face's `inv_freq` buffer).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The `cos` and `sin` tables of positions `0..seq`, each `[seq, head_dim]` in `dtype`: the
    /// angle `position * inv_freq` in f32, repeated over the two halves of the head, its cosine
    /// and sine in f32, then cast (Hugging Face's `LlamaRotaryEmbedding.forward`).
    pub fn cos_sin(
        &self,
        backend: &BackendRef,
        seq: usize,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(seq * 2 * half);
        let mut sin = Vec::with_capacity(seq * 2 * half);
        for position in 0..seq {
            for _ in 0..2 {
                for &inv in &self.inv_freq {
                    let angle = f64::from(position as f32 * inv);
                    cos.push(f64::from(angle.cos() as f32));
                    sin.push(f64::from(angle.sin() as f32));
                }
            }
        }
        let shape = [seq, 2 * half];
        Ok((
            Tensor::from_f64s(backend, &cos, &shape, dtype)?,
            Tensor::from_f64s(backend, &sin, &shape, dtype)?,
        ))
    }
}

/// `x * cos + rotate_half(x) * sin` for `x` `[batch, heads, seq, head_dim]` (any strides) and
/// tables `[seq, head_dim]` (Hugging Face's `apply_rotary_pos_emb`; the tables are cast to `x`'s
/// dtype): autograd-core's fused `rotary_embedding`, which saves nothing of `x` and lays the
/// result out in `x`'s memory order.
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Ok(rotary_embedding(x, cos, sin)?)
}
