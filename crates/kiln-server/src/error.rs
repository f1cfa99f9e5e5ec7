//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// Seconds after which a retry may succeed (sent as `Retry-After`).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: None, retry_after: None }
    }

    /// A 400 naming the field at fault.
    pub fn field(param: &str, message: impl std::fmt::Display) -> ApiError {
        ApiError { param: Some(param.to_string()), ..ApiError::new(StatusCode::BAD_REQUEST, format!("{param}: {message}")) }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unavailable(message: impl Into<String>, retry_after: u32) -> ApiError {
        ApiError { retry_after: Some(retry_after), ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message) }
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind(), "param": self.param, "code": self.status.as_u16() } })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
