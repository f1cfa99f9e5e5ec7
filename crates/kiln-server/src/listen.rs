//! Accepting connections: HTTP/1.1 through hyper with a limit on the time a request's headers
//! take to arrive, which `axum::serve` does not set, so a client that trickles its headers (or
//! leaves a kept-alive connection idle) cannot hold a connection forever.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// Serves `router` on `listener` until `stop` completes, each connection's request headers
/// due within `header_read_timeout`; then waits for the open connections to finish their
/// responses (the caller bounds that wait).
pub async fn serve_http(listener: TcpListener, router: Router, header_read_timeout: Duration, stop: impl Future<Output = ()>) {
    let connections = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, a connection reset before accept, ...: the listener
                // itself stays good, so wait a moment instead of spinning.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Server-sent events go out a token at a time; don't hold them back for coalescing.
        let _ = stream.set_nodelay(true);
        let mut builder = http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
        let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let connection = connections.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
    connections.shutdown().await;
}
