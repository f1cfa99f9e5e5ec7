//! `kiln tokenize`: token ids of a text, like llama-tokenize.

use std::path::PathBuf;

use clap::Parser;
use kiln_tokenizer::Tokenizer;

use crate::CliResult;

#[derive(Parser, Debug)]
pub struct TokenizeArgs {
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    #[arg(short = 'p', long)]
    pub prompt: String,
    /// Print only the ids, as a list.
    #[arg(long)]
    pub ids: bool,
    /// Do not add BOS/EOS even where the model asks for them.
    #[arg(long)]
    pub no_bos: bool,
    /// Do not recognise special-token text such as "<|im_end|>".
    #[arg(long)]
    pub no_parse_special: bool,
}

pub fn tokenize(args: TokenizeArgs) -> CliResult {
    let file = crate::run::open_model(&args.model)?;
    let tok = Tokenizer::from_gguf(&file)?;
    let ids = tok.encode(&args.prompt, !args.no_bos, !args.no_parse_special);
    if args.ids {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("[{}]", list.join(", "));
    } else {
        for id in ids {
            println!("{id:6} -> '{}'", String::from_utf8_lossy(tok.piece(id, true)));
        }
    }
    Ok(())
}
