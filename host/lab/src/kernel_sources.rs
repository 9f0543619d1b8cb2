//! `--dump-kernel-sources`: the full CUDA source of every fused kernel a decode step and a
//! verify window call, as MLX would compile it, recorded on the CPU for
//! `bench/gpu/compile_check.py`.

use anyhow::{Context, Result};

use mlx_spec::generate::prefill;
use mlx_spec::model::gemma4::{Gemma4Model, LogitsFor};

/// `mlx-spec-lab --dump-kernel-sources`: one decode forward of `model` per kernel set, and verify
/// windows of 2, 4 and 8 tokens, their fused-kernel calls recorded ([`mlx_spec::kernels::capture_kernels`]); each distinct
/// source written once.
pub(crate) fn dump_kernel_sources(
    model: &mut Gemma4Model,
    prompt: &[u32],
    dir: &std::path::Path,
) -> Result<()> {
    use mlx_spec::kernels::{capture_kernels, CudaDecode, Fused};
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut cache = model.new_cache();
    let logits = prefill(model, &mut cache, prompt)?;
    let token = mlx_rs::ops::indexing::argmax_axis(&logits, -1, false)?.reshape(&[1, 1])?;
    let every = Fused::every();
    let install = |model: &mut Gemma4Model, kernels: Fused| -> Result<()> {
        let fast = CudaDecode::new(model, kernels)?;
        model.set_fast_path(Some(Box::new(fast)));
        Ok(())
    };
    // Kernel sets: the default (the post-attention kernel serves every layer it can), the
    // product kernels in its place (as for layers it does not serve), attention alone (the
    // attention-inputs kernel, as for layers the attention-heads kernel does not serve).
    let sets = [
        every,
        Fused {
            post_attention: false,
            affine4: false,
            ..every
        },
        Fused {
            attention: true,
            ..Fused::default()
        },
    ];
    let mut written: Vec<mlx_spec::kernels::CapturedKernel> = Vec::new();
    let mut run = || -> Result<()> {
        for kernels in sets {
            install(model, kernels)?;
            let (_, calls) =
                capture_kernels(|| model.forward_ids(&token, &mut cache, LogitsFor::Last, false))?;
            cache
                .trim(1)
                .map_err(|e| anyhow::anyhow!("cannot rewind the cache: {e:?}"))?;
            for call in calls {
                if !written.iter().any(|w| w.source == call.source) {
                    written.push(call);
                }
            }
        }
        // Verify windows of 2, 4 and 8 tokens (the window kernels).
        install(model, every)?;
        for tokens in [2, 4, 8] {
            let ids = mlx_rs::ops::broadcast_to(&token, &[1, tokens])?;
            let (_, calls) =
                capture_kernels(|| model.forward_ids(&ids, &mut cache, LogitsFor::All, false))?;
            cache
                .trim(tokens as usize)
                .map_err(|e| anyhow::anyhow!("cannot rewind the cache: {e:?}"))?;
            for call in calls {
                if !written.iter().any(|w| w.source == call.source) {
                    written.push(call);
                }
            }
        }
        Ok(())
    };
    let result = run();
    model.set_fast_path(None);
    result?;
    let mut list = String::from("file\tkernel\tblock\tblocks\tdynamic_shared\n");
    for k in &written {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        k.source.hash(&mut hasher);
        let file = format!("{}-{:016x}.cu", k.name, hasher.finish());
        std::fs::write(dir.join(&file), &k.source)
            .with_context(|| format!("cannot write {}", dir.join(&file).display()))?;
        list += &format!(
            "{file}\t{}\t{}\t{}\t{}\n",
            k.name, k.block, k.blocks, k.shared_bytes
        );
    }
    std::fs::write(dir.join("kernels.tsv"), list)?;
    println!(
        "{} distinct kernel sources in {} (kernels.tsv lists them)",
        written.len(),
        dir.display()
    );
    Ok(())
}
