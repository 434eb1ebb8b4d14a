/* The float64 gate functions of rnn_common.h (fast_exp, fast_tanh and the sigmoid the step
   kernels build from fast_exp) against libm's, in units of the last place of libm's result over
   their ranges, and their special values. Compiled and run by tests/test_rnn_gate_math.py; prints
   one "name value" pair a line. */
#include <stdio.h>

#include "rnn_common.h"

static double ulps(double got, double want) {
    const double unit = nextafter(fabs(want), INFINITY) - fabs(want);
    return fabs(got - want) / unit;
}

int main(void) {
    double exp_ulp = 0, tanh_ulp = 0, sigmoid_ulp = 0, tanh_small_ulp = 0;
    for (double x = -707.5; x < 709.0; x += 0.000731) {
        exp_ulp = fmax(exp_ulp, ulps(fast_exp(x), exp(x)));
        if (tanh(x) != 0) tanh_ulp = fmax(tanh_ulp, ulps(fast_tanh(x), tanh(x)));
        const double s = 1.0 / (1.0 + exp(-x));
        if (s > 1e-300) sigmoid_ulp = fmax(sigmoid_ulp, ulps(1.0 / (1.0 + fast_exp(-x)), s));
    }
    for (double x = -1e-6; x < 1e-6; x += 1.37e-10)
        if (x != 0) tanh_small_ulp = fmax(tanh_small_ulp, ulps(fast_tanh(x), tanh(x)));
    printf("exp_ulp %.3f\ntanh_ulp %.3f\nsigmoid_ulp %.3f\ntanh_small_ulp %.3f\n", exp_ulp, tanh_ulp,
           sigmoid_ulp, tanh_small_ulp);
    printf("tanh_zero_sign %d\ntanh_minus_zero_sign %d\n", signbit(fast_tanh(0.0)) != 0,
           signbit(fast_tanh(-0.0)) != 0);
    printf("exp_nan %d\ntanh_nan %d\n", isnan(fast_exp(NAN)), isnan(fast_tanh(NAN)));
    printf("tanh_huge %.17g\ntanh_minus_huge %.17g\nexp_low %.17g\nexp_high_finite %d\n",
           fast_tanh(1e300), fast_tanh(-1e300), fast_exp(-1e4), isfinite(fast_exp(1e4)));
    return 0;
}
