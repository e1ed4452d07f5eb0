//! Small layers with PyTorch's parameter names (`weight`, `bias`) and default
//! initialisation, so a `VarStore` holds the same keys and shapes as a PyTorch
//! state_dict: Linear, LayerNorm, Conv2d/Conv3d, the GEGLU MLP and drop path. Each
//! forward is fallible (`f_forward`, like tch's `f_*` calls): a libtorch failure such
//! as an out-of-memory is returned, never a panic.

use tch::{nn, Kind, TchError, Tensor};

/// A fully connected layer acting on the last dimension.
#[derive(Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// `weight` (out, in) and `bias` (out), both U(-1/sqrt(in), 1/sqrt(in)) as in PyTorch.
    pub fn new(p: &nn::Path, in_dim: i64, out_dim: i64, bias: bool) -> Linear {
        let bound = 1.0 / (in_dim as f64).sqrt();
        let weight = p.uniform("weight", &[out_dim, in_dim], -bound, bound);
        let bias = bias.then(|| p.uniform("bias", &[out_dim], -bound, bound));
        Linear { weight, bias }
    }

    /// Applies the layer to the last dimension of `x`.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        x.f_linear(&self.weight, self.bias.as_ref())
    }

    /// The same layer sharing its parameters (for closures that must own them).
    pub fn shallow_clone(&self) -> Linear {
        Linear {
            weight: self.weight.shallow_clone(),
            bias: self.bias.as_ref().map(Tensor::shallow_clone),
        }
    }
}

/// Layer normalisation over the last dimension (eps 1e-5).
#[derive(Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    dim: i64,
}

impl LayerNorm {
    /// `weight` ones and `bias` zeros of size `dim`.
    pub fn new(p: &nn::Path, dim: i64) -> LayerNorm {
        LayerNorm {
            weight: p.ones("weight", &[dim]),
            bias: p.zeros("bias", &[dim]),
            dim,
        }
    }

    /// Normalises the last dimension.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        x.f_layer_norm([self.dim], Some(&self.weight), Some(&self.bias), 1e-5, true)
    }

    /// The same layer sharing its parameters (for closures that must own them).
    pub fn shallow_clone(&self) -> LayerNorm {
        LayerNorm {
            weight: self.weight.shallow_clone(),
            bias: self.bias.shallow_clone(),
            dim: self.dim,
        }
    }
}

/// A 2-D or 3-D convolution, stride 1, with PyTorch's default initialisation.
#[derive(Debug)]
pub struct Conv {
    weight: Tensor,
    bias: Option<Tensor>,
    padding: Vec<i64>,
    stride: Vec<i64>,
}

impl Conv {
    /// A convolution with kernel `kernel` (2 or 3 sizes), `padding` per dimension, bias.
    pub fn new(p: &nn::Path, in_dim: i64, out_dim: i64, kernel: &[i64], padding: &[i64]) -> Conv {
        Conv::strided(p, in_dim, out_dim, kernel, padding, &vec![1; kernel.len()])
    }

    /// A 3x3 convolution of each frame of (N, C, D, H, W) (kernel 1x3x3, same size).
    pub fn per_frame(p: &nn::Path, in_dim: i64, out_dim: i64) -> Conv {
        Conv::new(p, in_dim, out_dim, &[1, 3, 3], &[0, 1, 1])
    }

    /// As [`Conv::per_frame`] with stride 2 in height and width: half the size.
    pub fn down_frame(p: &nn::Path, in_dim: i64, out_dim: i64) -> Conv {
        Conv::strided(p, in_dim, out_dim, &[1, 3, 3], &[0, 1, 1], &[1, 2, 2])
    }

    /// As [`Conv::new`] with a stride per dimension.
    pub fn strided(
        p: &nn::Path,
        in_dim: i64,
        out_dim: i64,
        kernel: &[i64],
        padding: &[i64],
        stride: &[i64],
    ) -> Conv {
        let fan_in = in_dim * kernel.iter().product::<i64>();
        let bound = 1.0 / (fan_in as f64).sqrt();
        let mut shape = vec![out_dim, in_dim];
        shape.extend_from_slice(kernel);
        let weight = p.uniform("weight", &shape, -bound, bound);
        let bias = Some(p.uniform("bias", &[out_dim], -bound, bound));
        Conv {
            weight,
            bias,
            padding: padding.to_vec(),
            stride: stride.to_vec(),
        }
    }

    /// Zeroes weight and bias (the reference does this for the last offset conv).
    pub fn zero_(&mut self) {
        tch::no_grad(|| {
            let _ = self.weight.zero_();
            if let Some(b) = &mut self.bias {
                let _ = b.zero_();
            }
        });
    }

    /// Applies the convolution to (N, C, H, W) or (N, C, D, H, W).
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let dilation = vec![1; self.padding.len()];
        x.f_convolution(
            &self.weight,
            self.bias.as_ref(),
            &self.stride,
            &self.padding,
            &dilation,
            false,
            vec![0; self.padding.len()],
            1,
        )
    }
}

/// Multilayer perceptron with a GELU-gated linear unit: `fc2(gelu(fc11 x) * fc12 x)`.
#[derive(Debug)]
pub struct MlpGeglu {
    fc11: Linear,
    fc12: Linear,
    fc2: Linear,
}

impl MlpGeglu {
    /// Parameters `fc11`, `fc12` (in -> hidden) and `fc2` (hidden -> out).
    pub fn new(p: &nn::Path, in_dim: i64, hidden: i64, out_dim: i64) -> MlpGeglu {
        MlpGeglu {
            fc11: Linear::new(&(p / "fc11"), in_dim, hidden, true),
            fc12: Linear::new(&(p / "fc12"), in_dim, hidden, true),
            fc2: Linear::new(&(p / "fc2"), hidden, out_dim, true),
        }
    }

    /// Applies the MLP to the last dimension.
    pub fn f_forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let gated = self
            .fc11
            .f_forward(x)?
            .f_gelu("none")?
            .f_mul(&self.fc12.f_forward(x)?)?;
        self.fc2.f_forward(&gated)
    }

    /// The same MLP sharing its parameters (for closures that must own them).
    pub fn shallow_clone(&self) -> MlpGeglu {
        MlpGeglu {
            fc11: self.fc11.shallow_clone(),
            fc12: self.fc12.shallow_clone(),
            fc2: self.fc2.shallow_clone(),
        }
    }
}

/// Leaky ReLU with a chosen negative slope (below 1).
pub fn f_leaky_relu(x: &Tensor, slope: f64) -> Result<Tensor, TchError> {
    x.f_maximum(&x.f_mul_scalar(slope)?)
}

/// Stochastic depth: in training, zeroes whole samples with probability `rate` and
/// rescales the rest by 1/(1-rate); identity in evaluation or at rate 0.
pub fn f_drop_path(x: &Tensor, rate: f64, train: bool) -> Result<Tensor, TchError> {
    if rate <= 0.0 || !train {
        return Ok(x.shallow_clone());
    }
    let keep = 1.0 - rate;
    let mut shape = vec![x.size()[0]];
    shape.extend(std::iter::repeat_n(1, x.dim() - 1));
    let mask = Tensor::f_rand(&shape, (x.kind(), x.device()))?
        .f_add_scalar(keep)?
        .f_floor()?;
    x.f_div_scalar(keep)?.f_mul(&mask)
}

/// Truncated normal in [-2 std, 2 std] (timm's `trunc_normal_` with a = -2, b = 2 in std units
/// when std is small, as VRT uses it for the relative position bias tables).
pub fn trunc_normal(p: &nn::Path, name: &str, shape: &[i64], std: f64) -> Tensor {
    let t = p.zeros(name, shape);
    tch::no_grad(|| {
        let sample = (Tensor::randn(shape, (Kind::Float, t.device())) * std).clamp(-2.0, 2.0);
        let mut dst = t.shallow_clone();
        dst.copy_(&sample);
    });
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geglu_matches_its_formula() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let mlp = MlpGeglu::new(&(vs.root() / "mlp"), 4, 6, 3);
        let x = Tensor::randn([2, 5, 4], (Kind::Float, tch::Device::Cpu));
        let vars = vs.variables();
        let lin = |name: &str, x: &Tensor| {
            x.matmul(&vars[&format!("mlp.{name}.weight")].tr()) + &vars[&format!("mlp.{name}.bias")]
        };
        let h = lin("fc11", &x);
        let gelu = &h * 0.5 * (1.0 + (&h / 2f64.sqrt()).erf());
        let expected = lin("fc2", &(gelu * lin("fc12", &x)));
        let got = mlp.f_forward(&x).unwrap();
        assert_eq!(got.size(), vec![2, 5, 3]);
        assert!(got.allclose(&expected, 1e-5, 1e-5, false));
        let mut names: Vec<_> = vars.keys().cloned().collect();
        names.sort();
        assert_eq!(names.len(), 6);
        assert_eq!(names[0], "mlp.fc11.bias");
    }

    #[test]
    fn drop_path_is_identity_in_eval_and_drops_samples_in_training() {
        let x = Tensor::ones([64, 3], (Kind::Float, tch::Device::Cpu));
        assert!(f_drop_path(&x, 0.5, false).unwrap().equal(&x));
        let y = f_drop_path(&x, 0.5, true).unwrap();
        let per_sample = y.sum_dim_intlist([1i64].as_slice(), false, Kind::Float);
        let values: Vec<f32> = Vec::try_from(per_sample).unwrap();
        assert!(values.iter().all(|&v| v == 0.0 || (v - 6.0).abs() < 1e-5));
        assert!(values.contains(&0.0) && values.iter().any(|&v| v > 0.0));
    }
}
