//! Before the model is ready: /health and every model endpoint answer 503 (with Retry-After),
//! while the HTTP side is already up.

mod common;

use std::sync::Arc;

use common::{request, serve};
use kiln_server::http::AppState;
use kiln_server::metrics::Metrics;
use kiln_server::scheduler::SchedulerHandle;

#[test]
fn endpoints_answer_503_while_the_model_loads() {
    let (commands, _receiver) = std::sync::mpsc::channel();
    let state = Arc::new(AppState::new(SchedulerHandle::new(commands), Arc::new(Metrics::default()), None, 1 << 20));
    let (_runtime, addr) = serve(state);

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
