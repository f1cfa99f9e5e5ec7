//! Step graphs: a stream capture instantiated for replay, with the kernel-to-kernel edges into
//! kernels that wait for their own inputs (sources tagged `// kiln-waits-for-inputs`) made
//! programmatic. Such a kernel is launched as soon as every block of the kernel before it has
//! started, streams its weights while that kernel drains, and waits for its results in
//! `wait_for_inputs()` (common.cuh): the gap between launches disappears.

use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUfunction, CUgraph, CUgraphEdgeData, CUgraphExec, CUgraphNode, CUgraphNodeType};
use cudarc::driver::{result, CudaStream, DriverError};

/// How the kernels of a captured step follow each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GraphEdges {
    /// A kernel that waits for its inputs starts while the one before it finishes (sm_90 and later).
    #[default]
    Overlapped,
    /// Each kernel starts after the one before it has finished, as in the stream it was captured from.
    Serial,
}

/// An instantiated step graph; owns both the graph and its executable.
pub(crate) struct StepGraphExec {
    graph: CUgraph,
    exec: CUgraphExec,
    stream: Arc<CudaStream>,
}

// SAFETY: the handles are only used through `&self`/`Drop` while the owner's lock is held.
unsafe impl Send for StepGraphExec {}

impl StepGraphExec {
    /// Ends the capture begun on `stream` (None if it recorded nothing), turns the edges into
    /// kernels for which `waits_for_inputs` holds programmatic, and instantiates the graph.
    /// Returns the graph and how many edges overlap.
    pub(crate) fn end_capture(stream: &Arc<CudaStream>, waits_for_inputs: &dyn Fn(CUfunction) -> bool) -> Result<Option<(Self, usize)>, DriverError> {
        stream.context().bind_to_thread()?;
        // SAFETY: the stream is capturing (begun by the caller); the graph handed back is ours.
        let graph = unsafe { result::stream::end_capture(stream.cu_stream()) }?;
        if graph.is_null() {
            return Ok(None);
        }
        // SAFETY: `graph` is a valid graph owned here; it is destroyed on every error path.
        let built = unsafe { overlap_edges(graph, waits_for_inputs) }
            .and_then(|overlapped| unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }.map(|exec| (exec, overlapped)));
        match built {
            Ok((exec, overlapped)) => Ok(Some((StepGraphExec { graph, exec, stream: stream.clone() }, overlapped))),
            Err(error) => {
                // SAFETY: not instantiated, not used again.
                let _ = unsafe { result::graph::destroy(graph) };
                Err(error)
            }
        }
    }

    pub(crate) fn launch(&self) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: exec and stream are valid for self's lifetime.
        unsafe { result::graph::launch(self.exec, self.stream.cu_stream()) }
    }
}

impl Drop for StepGraphExec {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: owned handles, destroyed once; a failure here cannot be acted upon.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// Rewrites every kernel-to-kernel edge whose target waits for its inputs as a programmatic
/// edge from the source's programmatic port; returns how many were rewritten.
///
/// # Safety
/// `graph` must be a valid graph that no other thread touches.
unsafe fn overlap_edges(graph: CUgraph, waits_for_inputs: &dyn Fn(CUfunction) -> bool) -> Result<usize, DriverError> {
    let mut count = 0usize;
    sys::cuGraphGetEdges_v2(graph, ptr::null_mut(), ptr::null_mut(), ptr::null_mut(), &mut count).result()?;
    let mut from: Vec<CUgraphNode> = vec![ptr::null_mut(); count];
    let mut to: Vec<CUgraphNode> = vec![ptr::null_mut(); count];
    let mut data = vec![CUgraphEdgeData { from_port: 0, to_port: 0, type_: 0, reserved: [0; 5] }; count];
    sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut count).result()?;
    let programmatic = CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    };
    let mut rewritten = 0;
    for i in 0..count {
        if data[i].type_ != sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8 || kernel_of(from[i])?.is_none() {
            continue;
        }
        let Some(function) = kernel_of(to[i])? else { continue };
        if !waits_for_inputs(function) {
            continue;
        }
        sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &data[i], 1).result()?;
        sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &programmatic, 1).result()?;
        rewritten += 1;
    }
    Ok(rewritten)
}

/// The function a kernel node runs; None for other nodes (copies, memsets).
unsafe fn kernel_of(node: CUgraphNode) -> Result<Option<CUfunction>, DriverError> {
    let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    sys::cuGraphNodeGetType(node, &mut kind).result()?;
    if kind != CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok(None);
    }
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
    sys::cuGraphKernelNodeGetParams_v2(node, &mut params).result()?;
    Ok(Some(params.func))
}
