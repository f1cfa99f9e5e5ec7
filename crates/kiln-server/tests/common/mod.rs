//! What the server's integration tests share: the bundled model on the CPU, the HTTP server on
//! a free port, and raw HTTP requests to it.
// Each test file uses its own part of this module.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kiln_core::CpuBackend;
use kiln_gguf::GgufFile;
use kiln_models::{Engine, EngineOptions, Weights};
use kiln_server::http::{router, AppState};
use kiln_server::listen::serve_http;

/// The whole response (status line, headers, body) to one request on a fresh connection.
pub fn request(addr: &str, method: &str, path: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The server's routes over `state` on a free local port: the runtime serving them (keep it
/// alive) and the address.
pub fn serve(state: Arc<AppState>) -> (tokio::runtime::Runtime, String) {
    serve_with_header_timeout(state, Duration::from_secs(30))
}

/// `serve` with request headers due within `header_read_timeout`.
pub fn serve_with_header_timeout(state: Arc<AppState>, header_read_timeout: Duration) -> (tokio::runtime::Runtime, String) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    runtime.spawn(serve_http(listener, router(state), header_read_timeout, std::future::pending()));
    (runtime, addr)
}

/// The bundled model (stories260K) on the CPU: its engine and its file.
pub fn bundled_engine(options: &EngineOptions) -> (Engine<CpuBackend>, Arc<GgufFile>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    let backend = Arc::new(CpuBackend::new());
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let weights = Arc::new(Weights::load(&*backend, &file).unwrap());
    (Engine::new(backend, weights, options).unwrap(), file)
}
