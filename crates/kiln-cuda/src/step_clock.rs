//! Device-side timing of consecutive sampled steps: how long each kept the stream busy (from
//! the copy of its step block to the copy of its sampled tokens) and how long the stream sat
//! idle between the end of one such step and the start of the next, which is the host's
//! share of a token (waking from the wait, building the plan, launching the graph).

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, DriverError};

use crate::CudaDevice;

/// One sampled step as the device saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTime {
    /// From the step block's copy to the sampled tokens' copy, µs.
    pub busy_us: f32,
    /// From the end of the previous sampled step to this step's start, µs; None for a step
    /// after an unsampled one (a prefill), whose gap is not host overhead per token.
    pub idle_before_us: Option<f32>,
}

pub(crate) struct StepClock {
    start: CudaEvent,
    end: CudaEvent,
    previous_end: CudaEvent,
    /// A step was started and not yet sampled.
    started: bool,
    /// `previous_end` marks the end of the sampled step right before the current one.
    previous_valid: bool,
    pub(crate) times: Vec<StepTime>,
}

impl StepClock {
    pub(crate) fn new(device: &CudaDevice) -> Result<StepClock, DriverError> {
        let event = || device.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        Ok(StepClock { start: event()?, end: event()?, previous_end: event()?, started: false, previous_valid: false, times: Vec::new() })
    }

    /// Before the step block's copy.
    pub(crate) fn step_written(&mut self, stream: &CudaStream) -> Result<(), DriverError> {
        if self.started {
            // The step before was never sampled: the next gap would include its work.
            self.previous_valid = false;
        }
        self.start.record(stream)?;
        self.started = true;
        Ok(())
    }

    /// After the sampled tokens' copy was queued, before the wait for it.
    pub(crate) fn step_sampled(&mut self, stream: &CudaStream) -> Result<(), DriverError> {
        if self.started {
            self.end.record(stream)?;
        }
        Ok(())
    }

    /// After the wait: both events of the step (and the previous step's end) are complete.
    pub(crate) fn step_done(&mut self) -> Result<(), DriverError> {
        if !self.started {
            return Ok(());
        }
        let busy_us = self.start.elapsed_ms(&self.end)? * 1e3;
        let idle_before_us = if self.previous_valid { Some(self.previous_end.elapsed_ms(&self.start)? * 1e3) } else { None };
        self.times.push(StepTime { busy_us, idle_before_us });
        std::mem::swap(&mut self.end, &mut self.previous_end);
        self.previous_valid = true;
        self.started = false;
        Ok(())
    }
}
