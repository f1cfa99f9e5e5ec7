//! `kiln chat` driven through stdin with the shipped model.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn stories() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf")
}

/// Runs `kiln chat ARGS` with `input` on stdin.
fn chat(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("chat")
        .args(["-m", stories().to_str().unwrap(), "--device", "cpu", "-t", "1"])
        .args(args)
        .env("KILN_LOG", "kiln::chat=debug")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A chat that refuses to start exits without reading its input, so the pipe may be closed.
    match child.stdin.take().unwrap().write_all(input.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        written => written.unwrap(),
    }
    child.wait_with_output().unwrap()
}

/// The replies on stdout: each ends with a line holding only the record separator.
fn replies(out: &Output) -> Vec<String> {
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    let mut parts: Vec<String> = stdout.split("\n\u{1e}\n").map(str::to_string).collect();
    assert_eq!(parts.pop().as_deref(), Some(""), "stdout must end with a reply separator: {stdout:?}");
    parts
}

#[test]
fn two_turns_through_stdin_continue_the_conversation() {
    let args = ["--chat-template", "chatml", "--temp", "0", "-n", "16"];
    let input = "Once upon a time\nWhat happened next?\n";
    let first = chat(&args, input);
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(first.status.success(), "{stderr}");
    let got = replies(&first);
    assert_eq!(got.len(), 2, "{got:?}\n{stderr}");
    assert!(got.iter().all(|r| !r.trim().is_empty()), "{got:?}");
    // The second turn feeds only what follows the first turn's cached tokens.
    let reused: Vec<usize> = stderr.lines().filter_map(|l| l.split_once("tokens, ")?.1.split_once(" reused")?.0.parse().ok()).collect();
    assert_eq!(reused.len(), 2, "{stderr}");
    assert_eq!(reused[0], 0, "{stderr}");
    assert!(reused[1] > 16, "the second turn should reuse the first turn's tokens: {stderr}");
    // Greedy decoding is deterministic.
    let again = chat(&args, input);
    assert_eq!(replies(&again), got);
    // A one-turn session's reply is the first reply of the two-turn one.
    assert_eq!(replies(&chat(&args, "Once upon a time\n")), got[..1]);
}

#[test]
fn a_model_without_template_needs_one() {
    let out = chat(&[], "Hi\n");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tokenizer.chat_template") && stderr.contains("--chat-template"), "{stderr}");
    let out = chat(&["--chat-template", "nope"], "Hi\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("chatml"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn exit_command_and_system_prompt() {
    let out = chat(&["--chat-template", "chatml", "--temp", "0", "-n", "4", "-sys", "You tell stories."], "Hi\n/exit\nnot read\n");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(replies(&out).len(), 1);
}
