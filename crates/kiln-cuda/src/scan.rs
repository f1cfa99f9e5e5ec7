//! Text scanning of kernel sources, shared by `build.rs` (which derives the kernel table from
//! `kernels/*.cu`) and the library (whose tests check the scanner itself). Errors are plain
//! strings because the build script turns them into build failures.

/// Replaces comments with spaces (newlines kept) so commented-out code is never registered.
/// String and character literals are copied verbatim.
pub fn strip_comments(src: &str) -> String {
    blank_non_code(src, false)
}

/// Like [`strip_comments`], and also blanks the contents of string and character literals,
/// except the linkage specification `"C"`, so text inside literals cannot look like code.
pub fn code_only(src: &str) -> String {
    blank_non_code(src, true)
}

fn blank_non_code(src: &str, blank_literals: bool) -> String {
    let bytes = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &src[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').map_or(src.len(), |n| i + n);
            out.extend(std::iter::repeat_n(' ', end - i));
            i = end;
        } else if let Some(body) = rest.strip_prefix("/*") {
            let end = body.find("*/").map_or(src.len(), |n| i + 2 + n + 2);
            out.extend(src[i..end].chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
            i = end;
        } else if bytes[i] == b'"' || bytes[i] == b'\'' {
            let quote = bytes[i];
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != quote && bytes[j] != b'\n' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(bytes.len());
            let literal = &src[i..end];
            if blank_literals && literal != "\"C\"" && literal.len() >= 2 {
                out.push(quote as char);
                out.extend(std::iter::repeat_n(' ', literal.len() - 2));
                out.push(literal.chars().last().expect("non-empty literal"));
            } else {
                out.push_str(literal);
            }
            i = end;
        } else {
            let ch = rest.chars().next().expect("non-empty remainder");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Byte offsets of `word` in `code` where it stands as a whole identifier.
fn word_positions<'a>(code: &'a str, word: &'a str) -> impl Iterator<Item = usize> + 'a {
    code.match_indices(word).map(|(pos, _)| pos).filter(move |&pos| {
        let before = code.as_bytes()[..pos].last().copied();
        let after = code.as_bytes().get(pos + word.len()).copied();
        !before.is_some_and(is_ident_byte) && !after.is_some_and(is_ident_byte)
    })
}

/// Names of the kernels declared as `extern "C" __global__ void NAME(` (qualifiers such as
/// `__launch_bounds__(...)` may appear before the name). Every `__global__` function must use
/// that form: a C++-mangled kernel would be unreachable by name and unreadable in profilers.
pub fn kernel_names(src: &str) -> Result<Vec<String>, String> {
    let code = code_only(src);
    let mut names = Vec::new();
    for pos in word_positions(&code, "__global__") {
        let line = code[..pos].matches('\n').count() + 1;
        let head = code[..pos].trim_end();
        if !head.ends_with("extern \"C\"") {
            return Err(format!("line {line}: a __global__ function must be declared `extern \"C\" __global__ void NAME(`"));
        }
        let name = declared_name(&code[pos + "__global__".len()..]).map_err(|why| format!("line {line}: {why}"))?;
        if names.contains(&name) {
            return Err(format!("line {line}: kernel `{name}` is declared twice"));
        }
        names.push(name);
    }
    Ok(names)
}

/// Parses `void [qualifiers] NAME(` and returns NAME.
fn declared_name(after_global: &str) -> Result<String, String> {
    let mut rest = after_global.trim_start();
    rest = rest.strip_prefix("void").filter(|r| !r.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')).ok_or("a kernel must return void")?;
    loop {
        rest = rest.trim_start();
        let ident_len = rest.bytes().take_while(|&b| is_ident_byte(b)).count();
        if ident_len == 0 {
            return Err("expected the kernel name after `void`".into());
        }
        let ident = &rest[..ident_len];
        rest = rest[ident_len..].trim_start();
        if ident == "__launch_bounds__" || ident == "__cluster_dims__" {
            rest = skip_parenthesized(rest).ok_or(format!("unbalanced parentheses after {ident}"))?;
        } else if rest.starts_with('(') {
            return Ok(ident.to_string());
        } else if !ident.starts_with("__") {
            return Err(format!("unexpected `{ident}` before the kernel's parameter list"));
        }
    }
}

fn skip_parenthesized(text: &str) -> Option<&str> {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(&text[i + 1..]);
                }
            }
            _ if depth == 0 && !c.is_whitespace() => return None,
            _ => {}
        }
    }
    None
}

pub const TEST_DEFINES_TAG: &str = "// kiln-test-defines:";

/// Specializations the CI compile test builds: one per `// kiln-test-defines: A=1,B=2` line.
/// A source without such a line is tested once with no defines.
pub fn test_defines(src: &str) -> Result<Vec<Vec<(String, i64)>>, String> {
    let mut sets = Vec::new();
    for (index, line) in src.lines().enumerate() {
        let Some(spec) = line.trim_start().strip_prefix(TEST_DEFINES_TAG) else {
            continue;
        };
        let mut set = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|item| !item.is_empty()) {
            let (name, value) = item.split_once('=').ok_or(format!("line {}: `{item}` is not NAME=VALUE", index + 1))?;
            let value = value.trim().parse::<i64>().map_err(|e| format!("line {}: value of `{}`: {e}", index + 1, name.trim()))?;
            set.push((name.trim().to_string(), value));
        }
        sets.push(set);
    }
    if sets.is_empty() {
        sets.push(Vec::new());
    }
    Ok(sets)
}

pub const WAITS_FOR_INPUTS_TAG: &str = "// kiln-waits-for-inputs";

/// Whether the source declares, by a `// kiln-waits-for-inputs` line, that each of its kernels
/// calls `wait_for_inputs()` (common.cuh) before it touches anything but weights, so that a step
/// graph may start it while the kernel before it still runs.
pub fn waits_for_inputs(src: &str) -> bool {
    src.lines().any(|line| line.trim() == WAITS_FOR_INPUTS_TAG)
}

/// Targets of `#include` lines. Quoted includes name our own headers in `kernels/`; angle
/// includes are rejected because kernels must build with libnvrtc alone, without toolkit headers.
pub fn local_includes(src: &str) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    for (index, line) in strip_comments(src).lines().enumerate() {
        let Some(directive) = line.trim_start().strip_prefix('#') else {
            continue;
        };
        let Some(target) = directive.trim_start().strip_prefix("include") else {
            continue;
        };
        let target = target.trim();
        match target.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
            Some(name) => names.push(name.to_string()),
            None => return Err(format!("line {}: `#include {target}`: only our own headers (#include \"x.cuh\") are allowed", index + 1)),
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_come_from_extern_c_global_declarations() {
        let src = r#"
#include "common.cuh"
// extern "C" __global__ void commented_out(float* x) {}
/* extern "C" __global__ void also_commented(
   float* x) {} */
__device__ float helper(float x) { return x; }
extern "C" __global__ void first(float* out) {}
extern "C"   __global__   void
    second (const char* s = "__global__ in a string") {}
extern "C" __global__ void __launch_bounds__(256, 2) bounded(float* out) {}
"#;
        assert_eq!(kernel_names(src).unwrap(), ["first", "second", "bounded"]);
    }

    #[test]
    fn unnamed_or_mangled_kernels_are_rejected() {
        for bad in [
            "__global__ void mangled(float* x) {}",
            "template <int N> __global__ void templated(float* x) {}",
            "extern \"C\" { __global__ void in_block(float* x) {} }",
            "extern \"C\" __global__ int returns_int(float* x) {}",
            "extern \"C\" __global__ void twice(float* x) {}\nextern \"C\" __global__ void twice(int* y) {}",
        ] {
            assert!(kernel_names(bad).is_err(), "accepted: {bad}");
        }
        let error = kernel_names("\n\n__global__ void k() {}").unwrap_err();
        assert!(error.starts_with("line 3:"), "{error}");
    }

    #[test]
    fn test_define_lines_give_one_specialization_each() {
        let src = "// kiln-test-defines: BLOCK=128, ROWS=-4\n  // kiln-test-defines: BLOCK=1024\nint x;";
        assert_eq!(test_defines(src).unwrap(), vec![vec![("BLOCK".to_string(), 128), ("ROWS".to_string(), -4)], vec![("BLOCK".to_string(), 1024)]]);
        assert_eq!(test_defines("int x;").unwrap(), vec![Vec::<(String, i64)>::new()]);
        assert!(test_defines("// kiln-test-defines: BLOCK").is_err());
        assert!(test_defines("// kiln-test-defines: BLOCK=big").is_err());
    }

    #[test]
    fn the_wait_tag_is_a_whole_line() {
        assert!(waits_for_inputs("// a kernel\n// kiln-waits-for-inputs\n#include \"common.cuh\""));
        assert!(!waits_for_inputs("// kiln-waits-for-inputs: no\nint x;"));
        assert!(!waits_for_inputs("int x;"));
    }

    #[test]
    fn only_quoted_includes_are_allowed() {
        assert_eq!(local_includes("#include \"common.cuh\"\n# include \"b.cuh\"").unwrap(), ["common.cuh", "b.cuh"]);
        assert_eq!(local_includes("// #include <cuda_fp16.h>\n").unwrap(), Vec::<String>::new());
        assert!(local_includes("#include <cuda_fp16.h>").is_err());
    }

    #[test]
    fn comments_are_blanked_but_lines_and_strings_kept() {
        let src = "a // x\nb /* y\nz */ c \"// not a comment\"";
        let stripped = strip_comments(src);
        assert_eq!(stripped.lines().count(), src.lines().count());
        assert!(!stripped.contains('x') && !stripped.contains('y') && !stripped.contains('z'));
        assert!(stripped.contains("\"// not a comment\"") && stripped.contains(" c "));
        let code = code_only("extern \"C\" f(\"abc\", 'q'); // \"x\"");
        assert_eq!(code, "extern \"C\" f(\"   \", ' ');       ");
    }
}
