//! Private pools: the memory of captured CUDA graphs (PyTorch's graph pools:
//! `beginAllocateToPool`, `endAllocateToPool`, `releasePool`).
//!
//! A pool caches its blocks under its own virtual stream ([`PrivatePoolId::stream`]), so search,
//! splitting, merging and statistics are the ordinary ones, and a block of the pool is reused only
//! by later requests routed to the pool. While a routing is in force, `malloc` serves the routed
//! stream's requests from the pool, and no step touches the device in ways a stream capture
//! forbids (each module says what it skips). While a pool is live, no release step frees or
//! unmaps its memory, even its free blocks: a captured graph writes there on replay. Releasing it
//! returns its free memory at once; its blocks still allocated become ordinary cached blocks when
//! freed, which `empty_cache` returns.
//!
//! It sits on the parent module's state and on `release` (returning a released pool's free
//! memory). It must not know how blocks are found, split or merged, nor how memory is freed.

use super::{device_stream_only, CachingAllocator, PrivatePool, PrivatePoolId};
use crate::error::{AllocError, PrivatePoolMisuse};
use crate::storage::{Storage, StreamId};

impl<S: Storage> CachingAllocator<S> {
    /// A new live private pool, empty. Route a stream's requests to it with
    /// [`CachingAllocator::begin_allocate_to_pool`]; give it back with
    /// [`CachingAllocator::release_private_pool`].
    pub fn create_private_pool(&self) -> PrivatePoolId {
        let pool = PrivatePoolId::next();
        let record = PrivatePool {
            live: true,
            stream: None,
        };
        self.state.lock().private_pools.insert(pool, record);
        pool
    }

    /// From now on, requests on `stream` are served from `pool` (PyTorch's
    /// `beginAllocateToPool`): from its free blocks, or from new segments (or mapped pages) that
    /// belong to it. Requests on other streams are unaffected. Until
    /// [`CachingAllocator::end_allocate_to_pool`], the allocator does nothing a stream capture
    /// forbids: it records, queries and waits for no event, waits for no device work, and frees
    /// and unmaps nothing, so a request that neither a free block nor new memory can serve fails
    /// with [`AllocError::OutOfMemory`] at once.
    ///
    /// Only one routing is in force at a time, and a pool serves one stream. Errors
    /// ([`AllocError::PrivatePool`]): another routing is in force, `pool` is not live, it
    /// served another stream, or `stream` is a pool's virtual stream.
    pub fn begin_allocate_to_pool(
        &self,
        stream: StreamId,
        pool: PrivatePoolId,
    ) -> Result<(), AllocError> {
        let state = &mut *self.state.lock();
        let misuse = |misuse| Err(AllocError::PrivatePool { pool, misuse });
        if let Some((routed_stream, routed_pool)) = state.routing {
            return misuse(PrivatePoolMisuse::RoutingActive {
                stream: routed_stream,
                pool: routed_pool,
            });
        }
        device_stream_only(stream)?;
        let Some(record) = state.private_pools.get_mut(&pool).filter(|p| p.live) else {
            return misuse(PrivatePoolMisuse::NotLive);
        };
        match record.stream {
            Some(served) if served != stream => {
                return misuse(PrivatePoolMisuse::OtherStream(served))
            }
            _ => record.stream = Some(stream),
        }
        state.routing = Some((stream, pool));
        Ok(())
    }

    /// Stops the routing in force (PyTorch's `endAllocateToPool`); nothing happens when none is.
    /// Call it once the capture has ended: the frees that wait for other streams, deferred
    /// meanwhile, record their events on the next allocation or `empty_cache`.
    pub fn end_allocate_to_pool(&self) {
        self.state.lock().routing = None;
    }

    /// Ends `pool`'s life (PyTorch's `releasePool`): call it once nothing on the device uses the
    /// pool any more (its graph is destroyed and the work using its blocks has completed). Its
    /// free segments and free whole pages go back to the storage now (unmapping waits for the
    /// device first, as `empty_cache` does); while another pool is routed to, they stay cached
    /// until the next `empty_cache`. Blocks still allocated stay valid; freed later, they are
    /// cached under the dead pool, reused by nothing, until `empty_cache` returns them.
    ///
    /// Errors ([`AllocError::PrivatePool`]): `pool` is not live (unknown, or released already),
    /// or requests are being routed to it.
    pub fn release_private_pool(&self, pool: PrivatePoolId) -> Result<(), AllocError> {
        let state = &mut *self.state.lock();
        let misuse = |misuse| Err(AllocError::PrivatePool { pool, misuse });
        let Some(record) = state.private_pools.get_mut(&pool).filter(|p| p.live) else {
            return misuse(PrivatePoolMisuse::NotLive);
        };
        match state.routing {
            Some((_, routed)) if routed == pool => misuse(PrivatePoolMisuse::BeingRouted),
            Some(_) => {
                record.live = false;
                Ok(())
            }
            None => {
                record.live = false;
                state.release_dead_pool(pool)
            }
        }
    }
}
