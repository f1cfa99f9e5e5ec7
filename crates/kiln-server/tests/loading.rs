//! Before the model is ready: /health and every model endpoint answer 503 (with Retry-After),
//! while the HTTP side is already up.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use kiln_server::http::{router, AppState};
use kiln_server::metrics::Metrics;
use kiln_server::scheduler::SchedulerHandle;

fn request(addr: &str, method: &str, path: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn endpoints_answer_503_while_the_model_loads() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (commands, _receiver) = std::sync::mpsc::channel();
    let state = Arc::new(AppState::new(SchedulerHandle::new(commands), Arc::new(Metrics::default()), None, 1 << 20));
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    runtime.spawn(async move { axum::serve(listener, router(state)).await });

    let health = request(&addr, "GET", "/health", "");
    assert!(health.starts_with("HTTP/1.1 503"), "{health}");
    assert!(health.contains("\"status\":\"loading\""), "{health}");
    let completion = request(&addr, "POST", "/v1/completions", r#"{"prompt": "hi"}"#);
    assert!(completion.starts_with("HTTP/1.1 503") && completion.to_ascii_lowercase().contains("retry-after: 1"), "{completion}");
    assert!(completion.contains("still loading"), "{completion}");
    assert!(request(&addr, "GET", "/v1/models", "").starts_with("HTTP/1.1 503"));
    // Metrics and routing work before the model does.
    assert!(request(&addr, "GET", "/metrics", "").contains("kiln_requests_total 0"));
    assert!(request(&addr, "GET", "/nowhere", "").starts_with("HTTP/1.1 404"));
}
