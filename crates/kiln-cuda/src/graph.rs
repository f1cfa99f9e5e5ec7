//! Step graphs: a stream capture instantiated for replay, with the kernel-to-kernel edges into
//! kernels that wait for their own inputs (sources tagged `// kiln-waits-for-inputs`) made
//! programmatic. Such a kernel is launched as soon as every block of the kernel before it has
//! exited (or called `start_dependents()`), streams its weights while that kernel drains, and
//! waits for its results in `wait_for_inputs()` (common.cuh): the gap between launches disappears.

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

/// One node of a profiled step graph: a kernel (its name and launch shape) or another node kind.
#[derive(Clone, Debug)]
pub struct NodeTime {
    pub name: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub micros: f32,
}

/// The per-node profile of one step graph (`CudaBackend::profile_step_graphs`).
#[derive(Clone, Debug)]
pub struct StepProfile {
    /// The step object and key the graph was recorded for.
    pub slot: (u64, u64),
    /// The engine's key for the step's shape.
    pub key: u64,
    pub nodes: Vec<NodeTime>,
}

impl StepGraphExec {
    /// Replays a copy of the graph with an event recorded after every node and returns each
    /// node's time in run order. The copy runs serially (every edge an ordinary one), so a
    /// kernel's time includes its own ramp-up and drain, which overlapped edges partly hide.
    pub(crate) fn profile_nodes(&self) -> Result<Vec<NodeTime>, DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut copy: CUgraph = ptr::null_mut();
        // SAFETY: `self.graph` is valid; the copy is ours and destroyed below.
        unsafe { sys::cuGraphClone(&mut copy, self.graph).result()? };
        // SAFETY: `copy` is a valid graph that only this function touches.
        let timed = unsafe { time_nodes(copy, &self.stream) };
        // SAFETY: created above, not used again.
        let _ = unsafe { result::graph::destroy(copy) };
        timed
    }
}

/// Events created for one profile, destroyed when it ends however it ends.
struct Events(Vec<sys::CUevent>);

impl Events {
    fn add(&mut self) -> Result<sys::CUevent, DriverError> {
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)?;
        self.0.push(event);
        Ok(event)
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        for &event in &self.0 {
            // SAFETY: each event was created by `add` and is destroyed once.
            let _ = unsafe { result::event::destroy(event) };
        }
    }
}

/// Puts an event-record node after every node of `graph` (each former edge now leaves from
/// that event node), runs the graph twice and reads the second run's times.
///
/// # Safety
/// `graph` must be a valid graph that no other thread touches; it is rewired in place.
unsafe fn time_nodes(graph: CUgraph, stream: &Arc<CudaStream>) -> Result<Vec<NodeTime>, DriverError> {
    let mut count = 0usize;
    sys::cuGraphGetNodes(graph, ptr::null_mut(), &mut count).result()?;
    let mut nodes: Vec<CUgraphNode> = vec![ptr::null_mut(); count];
    sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count).result()?;
    let mut n_edges = 0usize;
    sys::cuGraphGetEdges_v2(graph, ptr::null_mut(), ptr::null_mut(), ptr::null_mut(), &mut n_edges).result()?;
    let mut from: Vec<CUgraphNode> = vec![ptr::null_mut(); n_edges];
    let mut to: Vec<CUgraphNode> = vec![ptr::null_mut(); n_edges];
    let mut data = vec![CUgraphEdgeData { from_port: 0, to_port: 0, type_: 0, reserved: [0; 5] }; n_edges];
    sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut n_edges).result()?;
    let positions: std::collections::HashMap<CUgraphNode, usize> = nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    // The driver lists every edge's ends among the graph's nodes; anything else is its error.
    let index = |node: CUgraphNode| positions.get(&node).copied().ok_or(DriverError(sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE));

    let mut events = Events(Vec::with_capacity(count + 1));
    let start = events.add()?;
    let mut start_node: CUgraphNode = ptr::null_mut();
    sys::cuGraphAddEventRecordNode(&mut start_node, graph, ptr::null(), 0, start).result()?;
    let mut after = Vec::with_capacity(count);
    for &node in &nodes {
        let event = events.add()?;
        let mut record: CUgraphNode = ptr::null_mut();
        sys::cuGraphAddEventRecordNode(&mut record, graph, &node, 1, event).result()?;
        after.push((record, event));
    }
    let mut preds: Vec<Vec<usize>> = vec![Vec::new(); count];
    for e in 0..n_edges {
        let (f, t) = (index(from[e])?, index(to[e])?);
        sys::cuGraphRemoveDependencies_v2(graph, &from[e], &to[e], &data[e], 1).result()?;
        sys::cuGraphAddDependencies_v2(graph, &after[f].0, &to[e], ptr::null(), 1).result()?;
        preds[t].push(f);
    }
    for (i, node) in nodes.iter().enumerate() {
        if preds[i].is_empty() {
            sys::cuGraphAddDependencies_v2(graph, &start_node, node, ptr::null(), 1).result()?;
        }
    }
    let exec = result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0))?;
    let ran = (0..2).try_for_each(|_| result::graph::launch(exec, stream.cu_stream())).and_then(|()| stream.synchronize());
    let _ = result::graph::exec_destroy(exec);
    ran?;

    let mut ends = Vec::with_capacity(count);
    for &(_, event) in &after {
        ends.push(result::event::elapsed(start, event)?);
    }
    // Run order: by when each node's event fired (a serial chain in practice).
    let mut order: Vec<usize> = (0..count).collect();
    order.sort_by(|&a, &b| ends[a].total_cmp(&ends[b]));
    let mut times = Vec::with_capacity(count);
    for i in order {
        let began = preds[i].iter().map(|&p| ends[p]).fold(0.0f32, f32::max);
        let (name, grid, block) = describe(nodes[i])?;
        times.push(NodeTime { name, grid, block, micros: (ends[i] - began) * 1000.0 });
    }
    Ok(times)
}

/// A node's name for the profile: the kernel's function name and launch shape, or its kind.
unsafe fn describe(node: CUgraphNode) -> Result<(String, [u32; 3], [u32; 3]), DriverError> {
    let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    sys::cuGraphNodeGetType(node, &mut kind).result()?;
    if kind != CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
        return Ok((format!("({kind:?})"), [0; 3], [0; 3]));
    }
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
    sys::cuGraphKernelNodeGetParams_v2(node, &mut params).result()?;
    let mut name: *const std::ffi::c_char = ptr::null();
    let named = sys::cuFuncGetName(&mut name, params.func).result().is_ok() && !name.is_null();
    let name = if named { std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned() } else { "(unnamed kernel)".into() };
    Ok((name, [params.gridDimX, params.gridDimY, params.gridDimZ], [params.blockDimX, params.blockDimY, params.blockDimZ]))
}
