//! fp8 saves as a per-block strategy: [`Float8Blocks`] runs the selected blocks of a model with
//! every plain `linear` in fp8 (autograd-core's `linear_float8_with` under one
//! [`Float8Recipe`]), so each such linear saves its input as one byte an element instead of two
//! or four, and runs its products on fp8 codes. The rest of the block runs as the autocast scope
//! around it says (bf16 autocast, or none); the model's head is outside every block, so it stays
//! in the scope's precision. Lossy: gradients move within fp8's rounding, as with 8-bit
//! compression, and the planner treats it so ([`Candidate::float8`](crate::Candidate::float8)).
//!
//! It sits on autograd-core's autocast seam and nn's block seam; it knows no kernel and no model
//! (which linears are "plain" is the model's: fused ops such as `layer_norm_linear` or SwiGLU's
//! MLP already save only their inputs, and stay as they are).

use std::sync::Arc;

use headroom_autograd_core::{
    autocast, autocast_policy, AutocastPolicy, CastPolicy, DType, Device, Float8Linear,
    Float8Recipe, Tensor,
};
use headroom_nn::{BlockForward, BlockRunner};

use crate::blocks::BlockSelection;

/// A block runner that runs the selected blocks with every plain linear in fp8 (see the module
/// docs).
///
/// ```
/// use headroom_autograd_core::{DType, Float8Recipe, Generator, Tensor};
/// use headroom_checkpoint::{BlockSelection, Float8Blocks};
/// use headroom_nn::{BlockStack, LlamaConfig, LlamaForCausalLM};
/// use std::sync::Arc;
///
/// let cpu = headroom_ops_cpu::CpuBackend::new_ref();
/// let mut llama = LlamaForCausalLM::new(&cpu, LlamaConfig::tiny(), DType::F32, &Generator::new(0))?;
/// let ids: Vec<i64> = (0..4 * 64).map(|i| (i * 7) % 100).collect();
/// let ids = Tensor::from_slice(&cpu, &ids, &[4, 64])?;
/// let allocated = || cpu.memory_stats().allocated_bytes.all.current;
/// let kept = |llama: &LlamaForCausalLM| -> Result<i64, Box<dyn std::error::Error>> {
///     let before = allocated();
///     let loss = llama.forward(&ids)?.sum_all()?;
///     let kept = allocated() - before;
///     loss.backward()?;
///     Ok(kept)
/// };
/// let plain = kept(&llama)?;
/// llama.set_block_runner(Some(Arc::new(Float8Blocks {
///     selection: BlockSelection::All,
///     recipe: Float8Recipe::TENSORWISE,
/// })));
/// // q, k and v share one copy of their input's codes; the down projection keeps one byte an
/// // element of SwiGLU's output.
/// assert!(kept(&llama)? < plain);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Float8Blocks {
    /// The blocks whose linears run in fp8.
    pub selection: BlockSelection,
    /// Their scales and gradient format.
    pub recipe: Float8Recipe,
}

impl BlockRunner for Float8Blocks {
    fn run(
        &self,
        index: usize,
        block: BlockForward,
        input: &Tensor,
    ) -> headroom_nn::Result<Tensor> {
        if !self.selection.contains(index) {
            return block(input);
        }
        let _scope = autocast(Arc::new(EveryLinear {
            base: autocast_policy(),
            recipe: self.recipe,
        }));
        block(input)
    }
}

/// The autocast policy inside a selected block: the enclosing scope's casts (or none), every
/// linear in fp8.
#[derive(Debug)]
struct EveryLinear {
    base: Option<Arc<dyn AutocastPolicy>>,
    recipe: Float8Recipe,
}

impl AutocastPolicy for EveryLinear {
    fn lower_precision(&self) -> DType {
        self.base.lower_precision()
    }

    fn cast_policy(&self, op: &'static str, device: Device) -> CastPolicy {
        self.base.cast_policy(op, device)
    }

    fn float8_linear(&self, _weight: &Tensor) -> Option<Float8Linear> {
        Some(Float8Linear::Current(self.recipe))
    }
}
