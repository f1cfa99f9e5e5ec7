//! A `kiln serve` process on a free loopback port with the bundled model on the CPU, and a
//! small HTTP/1.1 client over a raw TcpStream (requests with `Connection: close`).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["serve", "--port", "0", "--device", "cpu"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("kiln serve starts");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next().expect("a ready line").unwrap();
        let addr = line.split("http://").nth(1).unwrap_or_else(|| panic!("no URL in {line:?}")).trim().to_string();
        Server { child, addr }
    }

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s
    }

    pub fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> TcpStream {
        let mut s = self.connect();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n", self.addr, body.len());
        if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
            head += "Content-Type: application/json\r\n";
        }
        for (k, v) in headers {
            head += &format!("{k}: {v}\r\n");
        }
        head += "\r\n";
        s.write_all(head.as_bytes()).unwrap();
        // A server may answer (413) before reading all of a large body.
        let _ = s.write_all(body);
        s
    }

    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
        read_response(self.send(method, path, headers, body.as_bytes()))
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, &[], &body.to_string())
    }

    pub fn get(&self, path: &str) -> Response {
        self.request("GET", path, &[], "")
    }

    /// A metric's value from /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").body;
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).map(|v| v.parse().unwrap()))
            .unwrap_or_else(|| panic!("{name} not in {text}"))
    }

    /// Polls until `f` holds, for at most `secs` seconds.
    pub fn wait_for(&self, secs: u64, mut f: impl FnMut(&Server) -> bool) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(secs) {
            if f(self) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The JSON payloads of a server-sent event stream, and whether it ended with `[DONE]`.
    pub fn events(&self) -> (Vec<Value>, bool) {
        let mut events = Vec::new();
        let mut done = false;
        for data in self.body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
            if data == "[DONE]" {
                done = true;
            } else {
                events.push(serde_json::from_str(data).unwrap_or_else(|e| panic!("bad event ({e}): {data}")));
            }
        }
        (events, done)
    }
}

/// Reads the status line and headers of a response.
pub fn read_head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let status = line.split_whitespace().nth(1).unwrap_or_else(|| panic!("status line {line:?}")).parse().unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    (status, headers)
}

/// One chunk of a chunked body; `None` at the end.
pub fn read_chunk(reader: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut size = String::new();
    if reader.read_line(&mut size).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(size.trim(), 16).ok()?;
    let mut data = vec![0; n + 2];
    reader.read_exact(&mut data).ok()?;
    data.truncate(n);
    (n > 0).then_some(data)
}

pub fn read_response(stream: TcpStream) -> Response {
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader);
    let chunked = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        while let Some(c) = read_chunk(&mut reader) {
            body.extend(c);
        }
    } else {
        let _ = reader.read_to_end(&mut body);
    }
    Response { status, headers, body: String::from_utf8(body).expect("UTF-8 body") }
}
