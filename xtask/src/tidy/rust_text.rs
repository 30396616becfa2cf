//! Rust source as tidy's checks read it: a file told apart into code and literals ([`Lexed`]:
//! comments, strings, raw strings and char literals blanked, offsets and lines kept), and the
//! small readers of that code the checks share (balanced brackets, method chains, whole words).
//!
//! It sits on the text of one file. It must not know any tidy rule.

/// The methods called on the value that ends at `at` (`.name(..)`, `.name`, and `?` written
/// as a method), and where the chain ends.
pub(super) fn method_chain(code: &[u8], mut at: usize) -> (Vec<String>, usize) {
    let mut methods = Vec::new();
    loop {
        let next = skip_space(code, at);
        match code.get(next) {
            Some(b'?') => {
                methods.push("?".to_owned());
                at = next + 1;
            }
            Some(b'.') if code.get(next + 1) != Some(&b'.') => {
                let name_start = skip_space(code, next + 1);
                let name_len = code[name_start..]
                    .iter()
                    .take_while(|&&b| is_ident(b))
                    .count();
                if name_len == 0 {
                    return (methods, at);
                }
                let name = &code[name_start..name_start + name_len];
                methods.push(String::from_utf8_lossy(name).into_owned());
                at = name_start + name_len;
                let mut call = skip_space(code, at);
                if code[call..].starts_with(b"::<") {
                    call = closing(code, call + 2, b'<', b'>');
                    call = skip_space(code, call);
                }
                if code.get(call) == Some(&b'(') {
                    at = closing_paren(code, call);
                }
            }
            _ => return (methods, at),
        }
    }
}

/// Just past the `)` that closes the `(` at `open`.
pub(super) fn closing_paren(code: &[u8], open: usize) -> usize {
    closing(code, open, b'(', b')')
}

/// Just past the `close` that closes the `open` at `at`, or the end of the code.
pub(super) fn closing(code: &[u8], at: usize, open: u8, close: u8) -> usize {
    let mut depth = 0usize;
    for (i, &byte) in code.iter().enumerate().skip(at) {
        if byte == open {
            depth += 1;
        } else if byte == close {
            depth -= 1;
            if depth == 0 {
                return i + 1;
            }
        }
    }
    code.len()
}

pub(super) fn skip_space(code: &[u8], mut at: usize) -> usize {
    while code.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    at
}

pub(super) fn is_ident(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_' || byte >= 0x80
}

/// Where `word` (ASCII) stands as a whole word in `text`, ignoring case.
pub(super) fn word_positions<'a>(text: &'a str, word: &'a str) -> impl Iterator<Item = usize> + 'a {
    let bytes = text.as_bytes();
    let lower = text.to_ascii_lowercase();
    let word = word.to_ascii_lowercase();
    let positions: Vec<usize> = lower
        .match_indices(&word)
        .map(|(at, _)| at)
        .filter(|&at| {
            let clear_before = at == 0 || !is_ident(bytes[at - 1]);
            let clear_after = bytes.get(at + word.len()).is_none_or(|&b| !is_ident(b));
            clear_before && clear_after
        })
        .collect();
    positions.into_iter()
}

pub(super) fn has_word(text: &str, word: &str) -> bool {
    word_positions(text, word).next().is_some()
}

/// A Rust file told apart into code and literals.
pub(super) struct Lexed {
    /// The text with the insides of comments and literals blanked (each byte a space, newlines
    /// kept), so that offsets and lines are the text's and only code is left to read.
    pub(super) code: String,
    /// Each string literal (plain, byte, C or raw): its line and its contents as written.
    pub(super) strings: Vec<(usize, String)>,
    /// Where each line starts.
    line_starts: Vec<usize>,
}

impl Lexed {
    pub(super) fn new(text: &str) -> Lexed {
        let bytes = text.as_bytes();
        let mut code = bytes.to_vec();
        let mut strings = Vec::new();
        let line_starts: Vec<usize> = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(at, _)| at + 1))
            .collect();
        let line_of = |at: usize| line_starts.partition_point(|&start| start <= at);
        let blank = |code: &mut Vec<u8>, from: usize, to: usize| {
            for byte in &mut code[from..to.min(bytes.len())] {
                if *byte != b'\n' {
                    *byte = b' ';
                }
            }
        };
        let mut i = 0;
        while i < bytes.len() {
            let rest = &bytes[i..];
            let after_ident = i > 0 && is_ident(bytes[i - 1]);
            if rest.starts_with(b"//") {
                let end = rest
                    .iter()
                    .position(|&b| b == b'\n')
                    .map_or(bytes.len(), |n| i + n);
                blank(&mut code, i, end);
                i = end;
            } else if rest.starts_with(b"/*") {
                let end = block_comment_end(bytes, i);
                blank(&mut code, i, end);
                i = end;
            } else if let Some((open, hashes)) = raw_string_open(bytes, i, after_ident) {
                let close = [b"\"".as_slice(), &vec![b'#'; hashes]].concat();
                let contents_end = bytes[open..]
                    .windows(close.len())
                    .position(|window| window == close.as_slice())
                    .map_or(bytes.len(), |n| open + n);
                strings.push((line_of(i), text[open..contents_end].to_owned()));
                blank(&mut code, open, contents_end);
                i = contents_end + close.len();
            } else if bytes[i] == b'"' {
                let mut end = i + 1;
                while end < bytes.len() && bytes[end] != b'"' {
                    end += if bytes[end] == b'\\' { 2 } else { 1 };
                }
                let end = end.min(bytes.len());
                strings.push((line_of(i), text[i + 1..end].to_owned()));
                blank(&mut code, i + 1, end);
                i = end + 1;
            } else if bytes[i] == b'\'' {
                match char_literal_end(text, i) {
                    Some(end) => {
                        blank(&mut code, i + 1, end - 1);
                        i = end;
                    }
                    None => i += 1,
                }
            } else {
                i += 1;
            }
        }
        Lexed {
            code: String::from_utf8(code).expect("blanking keeps UTF-8"),
            strings,
            line_starts,
        }
    }

    /// The line (1-based) of byte `at`.
    pub(super) fn line_of(&self, at: usize) -> usize {
        self.line_starts.partition_point(|&start| start <= at)
    }
}

/// Just past the `*/` that closes the (nested) block comment opening at `at`.
fn block_comment_end(bytes: &[u8], at: usize) -> usize {
    let mut depth = 0usize;
    let mut i = at;
    while i + 1 < bytes.len() {
        match &bytes[i..i + 2] {
            b"/*" => {
                depth += 1;
                i += 2;
            }
            b"*/" => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    bytes.len()
}

/// For a raw string literal starting at `at` (`r"`, `r#"`, `br#"`, `cr"`, ...): where its
/// contents start and how many `#` close it.
fn raw_string_open(bytes: &[u8], at: usize, after_ident: bool) -> Option<(usize, usize)> {
    if after_ident {
        return None;
    }
    let rest = &bytes[at..];
    let prefix = [b"r".as_slice(), b"br", b"cr"]
        .into_iter()
        .find(|prefix| rest.starts_with(prefix))?;
    let hashes = rest[prefix.len()..]
        .iter()
        .take_while(|&&b| b == b'#')
        .count();
    let quote = at + prefix.len() + hashes;
    (bytes.get(quote) == Some(&b'"')).then_some((quote + 1, hashes))
}

/// Just past a char literal whose `'` is at `at`, or `None` for a lifetime or label.
fn char_literal_end(text: &str, at: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    if bytes.get(at + 1) == Some(&b'\\') {
        let close = bytes[at + 3..].iter().position(|&b| b == b'\'')?;
        return Some(at + 3 + close + 1);
    }
    let inside = text[at + 1..].chars().next()?;
    let close = at + 1 + inside.len_utf8();
    (bytes.get(close) == Some(&b'\'')).then_some(close + 1)
}
