//! Collectives of a tensor-parallel group: every rank holds a slice of the weights, computes a
//! partial result, and an all-reduce sums the partials so that each rank continues with the
//! whole. A GPU backend implements [`AllReduce`] with NCCL on its stream; [`HostAllReduce`] is
//! the host version, which lets the CPU run (and CI test) the sharded forward pass with ranks as
//! threads.

use std::sync::{Barrier, Mutex, PoisonError};

use crate::backend::{Backend, Result};
use crate::cpu::CpuBackend;
use crate::tensor::TensorMut;

/// Sums a buffer over the ranks of one group, in place, on every rank.
pub trait AllReduce<B: Backend>: Send + Sync {
    /// Ranks in the group.
    fn ranks(&self) -> usize;
    /// This handle's rank.
    fn rank(&self) -> usize;
    /// `x = sum over ranks of x`; every rank of the group must call it with the same shape, in
    /// the same order of calls.
    fn sum(&self, backend: &B, x: TensorMut<B::Buffer>) -> Result<()>;
}

/// A rank's shared handle on its group, as the engine holds it.
pub type GroupHandle<B> = std::sync::Arc<dyn AllReduce<B>>;

/// The shared half of a host group: each rank's contribution and two barriers.
struct HostGroup {
    ranks: usize,
    staging: Mutex<Vec<Vec<f32>>>,
    barrier: Barrier,
}

/// One rank's handle on a host all-reduce group (ranks are threads of one process). The sum is
/// taken in rank order on every rank, so all ranks get bit-identical results.
pub struct HostAllReduce {
    group: std::sync::Arc<HostGroup>,
    rank: usize,
}

impl HostAllReduce {
    /// One handle per rank of a new group of `ranks`.
    pub fn group(ranks: usize) -> Vec<HostAllReduce> {
        let group = std::sync::Arc::new(HostGroup { ranks, staging: Mutex::new(vec![Vec::new(); ranks]), barrier: Barrier::new(ranks) });
        (0..ranks).map(|rank| HostAllReduce { group: group.clone(), rank }).collect()
    }

    /// [`HostAllReduce::group`] as the handles an engine takes.
    pub fn handles(ranks: usize) -> Vec<GroupHandle<CpuBackend>> {
        Self::group(ranks).into_iter().map(|h| std::sync::Arc::new(h) as GroupHandle<CpuBackend>).collect()
    }

    fn sum_slice(&self, x: &mut [f32]) {
        let g = &*self.group;
        {
            let mut staging = g.staging.lock().unwrap_or_else(PoisonError::into_inner);
            let mine = &mut staging[self.rank];
            mine.clear();
            mine.extend_from_slice(x);
        }
        g.barrier.wait();
        {
            let staging = g.staging.lock().unwrap_or_else(PoisonError::into_inner);
            x.copy_from_slice(&staging[0]);
            for part in &staging[1..] {
                x.iter_mut().zip(part).for_each(|(v, p)| *v += p);
            }
        }
        // Nobody overwrites its contribution before every rank has read them all.
        g.barrier.wait();
    }
}

impl AllReduce<CpuBackend> for HostAllReduce {
    fn ranks(&self) -> usize {
        self.group.ranks
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn sum(&self, _backend: &CpuBackend, mut x: TensorMut<Vec<f32>>) -> Result<()> {
        self.sum_slice(x.data_mut());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DeviceBuffer;

    #[test]
    fn host_group_sums_in_rank_order_on_every_rank() {
        let handles = HostAllReduce::group(3);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let joins: Vec<_> = handles
                .iter()
                .map(|h| {
                    s.spawn(move || {
                        let mut x: Vec<f32> = (0..5).map(|i| (h.rank() * 10 + i) as f32 + 0.25).collect();
                        h.sum(&CpuBackend::new(), x.rows_mut(2, 2).unwrap()).unwrap();
                        // A second round reuses the staging buffers.
                        let mut y = vec![h.rank() as f32; 2];
                        h.sum(&CpuBackend::new(), y.rows_mut(1, 2).unwrap()).unwrap();
                        x.extend(y);
                        x
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for (rank, r) in results.iter().enumerate() {
            // Values 0..4 summed over ranks (0.25 + i, 10.25 + i, 20.25 + i), value 4 untouched.
            let want: Vec<f32> = (0..4).map(|i| 30.75 + 3.0 * i as f32).collect();
            assert_eq!(&r[..4], &want[..]);
            assert_eq!(r[4], (rank * 10 + 4) as f32 + 0.25);
            assert_eq!(&r[5..], &[3.0, 3.0]);
        }
    }
}
