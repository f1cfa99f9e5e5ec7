//! The all-reduce of a tensor-parallel group over NCCL: one communicator per GPU of the group,
//! the sum enqueued on that GPU's stream, so that it is captured in the rank's step graph like
//! any kernel. libnccl is loaded at run time; without it the group is a clear error.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::CudaSlice;
use cudarc::nccl::{Comm, ReduceOp};
use kiln_core::backend::{BackendError, Result};
use kiln_core::{AllReduce, GroupHandle, TensorMut};

use crate::{CudaBackend, CudaError};

/// An NCCL communicator handle. NCCL allows a communicator to be used from any thread as long
/// as calls on it do not overlap; the mutex around it guarantees that.
struct Communicator(Comm);

// SAFETY: see above: only ever used under `NcclAllReduce::comm`'s mutex.
unsafe impl Send for Communicator {}

/// One rank's handle on an NCCL group.
pub struct NcclAllReduce {
    comm: Mutex<Communicator>,
    rank: usize,
    ranks: usize,
}

impl NcclAllReduce {
    /// One handle per backend (each on its own GPU), in rank order.
    pub fn group(backends: &[&CudaBackend]) -> Result<Vec<NcclAllReduce>, CudaError> {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(CudaError::NcclUnavailable(
                "no libnccl.so on the library path (pip's nvidia-nccl wheel ships libnccl.so.2: link libnccl.so to it)".into(),
            ));
        }
        let streams = backends.iter().map(|b| b.device().stream().clone()).collect();
        let comms = Comm::from_devices(streams).map_err(|e| CudaError::Nccl { what: "communicator setup", error: format!("{e:?}") })?;
        let ranks = comms.len();
        Ok(comms.into_iter().enumerate().map(|(rank, comm)| NcclAllReduce { comm: Mutex::new(Communicator(comm)), rank, ranks }).collect())
    }

    /// [`NcclAllReduce::group`] as the handles an engine takes.
    pub fn handles(backends: &[&CudaBackend]) -> Result<Vec<GroupHandle<CudaBackend>>, CudaError> {
        Ok(Self::group(backends)?.into_iter().map(|g| Arc::new(g) as GroupHandle<CudaBackend>).collect())
    }
}

impl AllReduce<CudaBackend> for NcclAllReduce {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn sum(&self, _backend: &CudaBackend, mut x: TensorMut<CudaSlice<f32>>) -> Result<()> {
        let len = x.numel();
        let comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        let mut values = x.buf_mut().slice_mut(..len);
        comm.0.all_reduce_in_place(&mut values, &ReduceOp::Sum).map_err(|e| BackendError::Device(format!("NCCL all-reduce: {e:?}")))?;
        Ok(())
    }
}
