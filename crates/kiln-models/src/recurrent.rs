//! The recurrent state of hybrid models' Gated DeltaNet layers (Qwen3.5): per sequence, a
//! convolution state and a delta-rule state in every such layer, in numbered slots that a
//! sequence holds from its first step until it is released.

use kiln_core::{Backend, DeltaNetParams, DeviceBuffer, StateSlots};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

pub(crate) struct RecurrentStates<B: Backend> {
    /// Per DeltaNet layer, `[slots][conv state]` and `[slots][delta-rule state]`.
    pub conv: Vec<B::Buffer>,
    pub ssm: Vec<B::Buffer>,
    /// The slot of each sequence of the step, in plan order (f32, as the ops read them).
    pub slots: B::Buffer,
    free: Vec<u32>,
    host_slots: Vec<f32>,
    n_slots: usize,
}

/// The recurrent ops' parameters of a DeltaNet layer.
pub(crate) fn params(d: &crate::config::DeltaNetConfig) -> DeltaNetParams {
    DeltaNetParams { n_k_heads: d.n_k_heads, n_v_heads: d.n_v_heads, head_dim: d.head_dim, conv_kernel: d.conv_kernel }
}

impl<B: Backend> RecurrentStates<B> {
    /// States for `n_slots` sequences, or `None` for a model without recurrent layers.
    pub fn new(b: &B, c: &ModelConfig, n_slots: usize) -> Result<Option<RecurrentStates<B>>> {
        let layers: Vec<DeltaNetParams> = c.layers.iter().filter_map(|l| l.delta_net()).map(params).collect();
        if layers.is_empty() {
            return Ok(None);
        }
        let mut conv = Vec::with_capacity(layers.len());
        let mut ssm = Vec::with_capacity(layers.len());
        for (i, p) in layers.iter().enumerate() {
            conv.push(b.alloc(n_slots * p.conv_state(), &format!("DeltaNet {i} convolution state"))?);
            ssm.push(b.alloc(n_slots * p.ssm_state(), &format!("DeltaNet {i} state"))?);
        }
        let slots = b.alloc(n_slots, "state slots")?;
        Ok(Some(RecurrentStates { conv, ssm, slots, free: (0..n_slots as u32).rev().collect(), host_slots: Vec::with_capacity(n_slots), n_slots }))
    }

    /// DeltaNet layer `i`'s convolution and delta-rule states, each with the step's slots.
    pub fn layer(&mut self, i: usize, p: &DeltaNetParams) -> kiln_core::backend::Result<[StateSlots<'_, B::Buffer>; 2]> {
        let slots = self.slots.whole();
        Ok([
            StateSlots { state: self.conv[i].view_mut([self.n_slots, p.conv_state()])?, slots },
            StateSlots { state: self.ssm[i].view_mut([self.n_slots, p.ssm_state()])?, slots },
        ])
    }

    pub fn take(&mut self) -> Result<u32> {
        self.free.pop().ok_or_else(|| ModelError::BadHparam {
            key: "sequences".into(),
            reason: "every recurrent state slot is taken (one per sequence of max_seqs); release a sequence first".into(),
        })
    }

    pub fn release(&mut self, slot: u32) {
        self.free.push(slot);
    }

    /// Writes the step's slots, one per sequence in plan order.
    pub fn write_slots(&mut self, b: &B, slots: impl Iterator<Item = u32>) -> Result<()> {
        self.host_slots.clear();
        self.host_slots.extend(slots.map(|s| s as f32));
        Ok(b.write(&mut self.slots, &self.host_slots)?)
    }
}
