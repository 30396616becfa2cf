//! Which parameters are stepped in backward, process-wide: one optimizer in backward each.
//!
//! Two `InBackward`s over one parameter would update it twice per backward, silently. So each
//! claims its parameters here (by storage and offset, which identify a parameter for as long as
//! it lives) and releases them when dropped; a second claim is a typed error naming the
//! parameter. This module knows nothing about optimizers.

use std::collections::BTreeSet;
use std::sync::Arc;

use parking_lot::Mutex;

use headroom_autograd_core::Tensor;

use crate::error::HooksError;

static CLAIMED: Mutex<BTreeSet<(usize, usize)>> = Mutex::new(BTreeSet::new());

fn key(param: &Tensor) -> (usize, usize) {
    (
        Arc::as_ptr(param.buffer()) as usize,
        param.layout().offset(),
    )
}

/// The parameters one `InBackward` owns the in-backward updates of, until dropped.
#[derive(Debug)]
pub(crate) struct Claim {
    keys: Vec<(usize, usize)>,
}

impl Claim {
    /// Claims every parameter of `params`, or none if one is claimed already.
    pub(crate) fn new(params: &[Tensor]) -> Result<Claim, HooksError> {
        let mut claimed = CLAIMED.lock();
        let keys: Vec<_> = params.iter().map(key).collect();
        if let Some(index) = keys.iter().position(|k| claimed.contains(k)) {
            return Err(HooksError::AlreadyRegistered { index });
        }
        claimed.extend(keys.iter().copied());
        Ok(Claim { keys })
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut claimed = CLAIMED.lock();
        for key in &self.keys {
            claimed.remove(key);
        }
    }
}
