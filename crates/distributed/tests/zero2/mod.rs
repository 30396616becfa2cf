//! ZeRO-2 as the tests build it: one group's parameters, sharded over `comm` with no
//! reduce buckets of the sharded optimizer's own and no clipping, stepped inside backward by
//! hooks' InBackward in buckets of `bucket_bytes`, one micro-step a step.
//!
//! It sits on distributed's public API; it knows no backend and no model.

use std::sync::Arc;

use headroom_autograd_core::Tensor;
use headroom_distributed::{Communicator, ShardConfig, ShardedOptimizer};
use headroom_hooks::{InBackward, InBackwardConfig};
use headroom_optim::{Implementation, ParamGroup, UpdateRule};

/// The fused rule `rule` over `params`, sharded over `comm` and stepped in backward.
pub(crate) fn zero2_in_backward<R: UpdateRule>(
    params: Vec<Tensor>,
    rule: R,
    comm: Arc<dyn Communicator>,
    bucket_bytes: u64,
) -> InBackward {
    ShardedOptimizer::new(
        vec![ParamGroup::new(params, rule)],
        Implementation::Fused,
        comm,
        ShardConfig {
            bucket_bytes: 0,
            clipping: None,
        },
    )
    .unwrap()
    .into_in_backward(InBackwardConfig {
        bucket_bytes,
        accumulation: 1,
        clipping: None,
    })
    .unwrap()
}
